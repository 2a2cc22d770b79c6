"""The fused decode layer (engine/native/qkv_rope.py, fused_layer.py) against the PyTorch layer it replaces, in
Triton's CPU interpreter: the q/k/v + RoPE + cache-write kernel alone (fp32: tight; bf16: rounding-level), the whole
layer, and the native forward with ``kernels="layer"``."""
import pytest
import torch
import torch.nn.functional as F

from tilespec.engine.native import NativeRunner, fused_layer, linear, qkv_rope
from tilespec.engine.native.llama import decoder_layer, rms_norm, _rotate_half
from tilespec.engine.state import prefill_mask

from engine_models import tiny_config

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or linear._INTERPRET),
                                reason="needs CUDA or the Triton interpreter")
H, HKV, D, DM, C = 4, 2, 32, 96, 12
DEV = "cpu" if linear._INTERPRET else "cuda"


def _inputs(b, q, dtype, seed=0, bias=True):
    out = _inputs_cpu(b, q, dtype, seed, bias)
    return [x.to(DEV) if isinstance(x, torch.Tensor) else x for x in out[:-1]] + [[c.to(DEV) for c in out[-1]]]


def _inputs_cpu(b, q, dtype, seed, bias):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    h, r = rnd(b, q, DM).to(dtype), rnd(b, q, DM).to(dtype)
    norm = (torch.rand(DM, generator=g) + 0.5).to(dtype)
    w = (rnd((H + 2 * HKV) * D, DM) / DM ** 0.5).to(dtype)
    bvec = rnd((H + 2 * HKV) * D).to(dtype) if bias else None
    pos = torch.randint(0, 50, (b, q), generator=g).float()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.cat([pos[..., None] * inv_freq] * 2, dim=-1)
    caches = [torch.zeros(b, HKV, C, D, dtype=dtype) for _ in range(2)]
    return h, r, norm, w, bvec, emb.cos(), emb.sin(), caches


def _reference(h, r, norm, w, bvec, cos, sin, kc, vc, wp):
    b, q, _ = h.shape
    res = h + r
    proj = F.linear(rms_norm(res, norm, 1e-6), w, bvec)
    xq = proj[..., :H * D].view(b, q, H, D).transpose(1, 2)
    xk = proj[..., H * D:(H + HKV) * D].view(b, q, HKV, D).transpose(1, 2)
    xv = proj[..., (H + HKV) * D:].view(b, q, HKV, D).transpose(1, 2)
    c, s = cos[:, None], sin[:, None]
    xq = (xq * c + _rotate_half(xq) * s).to(h.dtype)
    xk = (xk * c + _rotate_half(xk) * s).to(h.dtype)
    kc[:, :, wp:wp + q] = xk
    vc[:, :, wp:wp + q] = xv
    return res, xq


@pytest.mark.parametrize("b,q", [(1, 1), (1, 5), (3, 2), (2, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_qkv_rope_matches_pytorch_fp32(b, q, bias):
    h, r, norm, w, bvec, cos, sin, (kc, vc) = _inputs(b, q, torch.float32, bias=bias)
    kref, vref = kc.clone(), vc.clone()
    wp = 4
    assert qkv_rope.can_run(h, w, kc, vc, D)
    res, xq = qkv_rope.qkv_rope(h, r, norm, w, bvec, cos, sin, kc, vc, torch.tensor(wp, device=DEV), heads=H, kv_heads=HKV,
                                head_dim=D, eps=1e-6)
    res_ref, xq_ref = _reference(h, r, norm, w, bvec, cos, sin, kref, vref, wp)
    torch.testing.assert_close(res, res_ref)
    torch.testing.assert_close(xq, xq_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kc, kref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vc, vref, rtol=1e-5, atol=1e-5)
    assert kc[:, :, :wp].abs().sum() == 0 and kc[:, :, wp + q:].abs().sum() == 0   # only the new slots written


@pytest.mark.parametrize("b,q", [(1, 1), (2, 3)])
def test_qkv_rope_bf16_within_rounding(b, q):
    h, r, norm, w, bvec, cos, sin, (kc, vc) = _inputs(b, q, torch.bfloat16, seed=2)
    kref, vref = kc.clone(), vc.clone()
    res, xq = qkv_rope.qkv_rope(h, r, norm, w, bvec, cos, sin, kc, vc, torch.tensor(0, device=DEV), heads=H, kv_heads=HKV,
                                head_dim=D, eps=1e-6)
    res_ref, xq_ref = _reference(h, r, norm, w, bvec, cos, sin, kref, vref, 0)
    if h.is_cuda:
        assert torch.equal(res, res_ref)                   # the residual sum is the same bf16 add
    else:   # the interpreter's fp32 -> bf16 conversion truncates instead of rounding to nearest: one step apart
        assert ((res.float() - res_ref.float()).abs() <= 2 ** -7 * res_ref.float().abs()).all()
    for got, want in ((xq, xq_ref), (kc, kref), (vc, vref)):
        # same rounding points, another summation order: within two bf16 steps of the values' scale
        assert (got.float() - want.float()).abs().max() <= 2 * 2 ** -7 * want.float().abs().max()


@pytest.mark.parametrize("b,q", [(1, 1), (2, 3)])
def test_fused_layer_equals_the_pytorch_layer_fp32(b, q):
    h, r, norm, w, bvec, cos, sin, (kc, vc) = _inputs(b, q, torch.float32, seed=5)
    g = torch.Generator().manual_seed(6)
    o = (torch.randn(DM, H * D, generator=g) / (H * D) ** 0.5).to(DEV)
    ln2 = (torch.rand(DM, generator=g) + 0.5).to(DEV)
    gate_up = (torch.randn(2 * 64, DM, generator=g) / DM ** 0.5).to(DEV)
    down = (torch.randn(DM, 64, generator=g) / 8).to(DEV)
    mask = torch.zeros(b, 1, q, C, device=DEV)
    mask[..., 7 + q:] = torch.finfo(torch.float32).min
    kc[:, :, :7] = torch.randn(b, HKV, 7, D, generator=g).to(DEV)
    vc[:, :, :7] = torch.randn(b, HKV, 7, D, generator=g).to(DEV)
    kref, vref = kc.clone(), vc.clone()
    args = (cos, sin, mask, torch.tensor(7, device=DEV))
    weights = (norm, w, bvec, o, ln2, gate_up, down)
    kw = dict(heads=H, kv_heads=HKV, head_dim=D, eps=1e-6)
    assert fused_layer.can_run(h, w, gate_up, kc, vc, D) == (b * q <= fused_layer.ROWS)
    out, res = fused_layer.fused_decoder_layer(h, r, *args, kc, vc, *weights, **kw)
    out_ref, res_ref = decoder_layer(h, r, *args, kref, vref, *weights, **kw)
    torch.testing.assert_close(res, res_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, out_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kc, kref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_forward_with_the_fused_layer(family):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM
    torch.manual_seed(0)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[family]
    model = cls(tiny_config(family, vocab=96, layers=2, hidden=128)).eval().to(DEV)
    ids = torch.tensor([[3, 9, 27, 81, 11, 5]], device=DEV)
    with torch.inference_mode():
        plain, fused = NativeRunner(model, 16), NativeRunner(model, 16, kernels="layer")
        pmask = prefill_mask(torch.ones(1, 6, dtype=torch.bool, device=DEV), 16)
        pos = torch.arange(6, device=DEV)[None]
        outs = [rn.forward(ids, pos, pmask, 0) for rn in (plain, fused)]
        mask = torch.zeros(1, 1, 2, 16, dtype=torch.bool, device=DEV)
        mask[..., :7] = True
        mask[..., 1, 7] = True
        steps = [rn.forward(torch.tensor([[42, 7]], device=DEV), torch.tensor([[6, 7]], device=DEV), mask, 6)
                 for rn in (plain, fused)]
        mask = torch.zeros(1, 1, 1, 16, dtype=torch.bool, device=DEV)
        mask[..., :9] = True
        steps += [rn.forward(torch.tensor([[13]], device=DEV), torch.tensor([[8]], device=DEV), mask, 8)
                  for rn in (plain, fused)]      # one row: the fused layer
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps[1], steps[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(steps[3], steps[2], atol=1e-4, rtol=1e-4)
    for (k0, v0), (k1, v1) in zip(plain.caches, fused.caches):
        torch.testing.assert_close(k1, k0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v0, atol=1e-5, rtol=1e-5)


def test_shapes_the_kernels_do_not_take_fall_back():
    h = torch.zeros(1, 100, DM, device=DEV)                # prefill-sized: more rows than the kernels take
    w = torch.zeros((H + 2 * HKV) * D, DM, device=DEV)
    kc = torch.zeros(1, HKV, C, D, device=DEV)
    assert not qkv_rope.can_run(h, w, kc, kc, D)
    assert not qkv_rope.can_run(h[:, :1], w, kc, kc, 12)   # head dim not a power of two
    assert not qkv_rope.can_run(h[:, :1], w.half(), kc, kc, D)   # dtype mismatch


def test_shared_runners_are_kept_apart_per_kernel_setting():
    from tilespec import settings
    from tilespec.engine.leases import release_compiled, shared_runner
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM(tiny_config("qwen2", vocab=96, layers=1, hidden=128)).eval()
    try:
        settings.configure(native_kernels="attn")
        first = shared_runner(model, "target", 16, 1, "native")
        settings.configure(native_kernels="layer,attn")
        other = shared_runner(model, "target", 16, 1, "native")
        settings.configure(native_kernels="attn")
        again = shared_runner(model, "target", 16, 1, "native")
    finally:
        settings.configure()
        release_compiled()
    assert other is not first and again is first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or linear._INTERPRET, reason="needs CUDA (pytest -m gpu)")
def test_fused_kernels_on_cuda():
    """The CPU tier's checks on CUDA tensors (compiled kernels instead of the interpreter)."""
    for b, q in ((1, 1), (1, 5), (2, 4)):
        test_qkv_rope_matches_pytorch_fp32(b, q, True)
        test_qkv_rope_bf16_within_rounding(b, q)
    test_fused_layer_equals_the_pytorch_layer_fp32(1, 1)
    test_native_forward_with_the_fused_layer("qwen2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or linear._INTERPRET, reason="needs CUDA (pytest -m gpu)")
def test_fused_layer_graphs_greedy_equal_bf16():
    """bf16 native-graphs decoding with and without the fused layer: the same greedy tokens (a random model whose
    LM head is sharpened, so the top two logits are far apart) and logits within bf16 rounding."""
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = tiny_config("qwen2", vocab=512, layers=3, hidden=256)
    model = Qwen2ForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    ids = torch.randint(0, 512, (1, 12), device="cuda")
    runs = []
    with torch.inference_mode():
        for kernels in ("", "layer"):
            rn = NativeRunner(model, 64, mode="native-graphs", kernels=kernels)
            pmask = prefill_mask(torch.ones(1, 12, dtype=torch.bool, device="cuda"), 64)
            logits = [rn.forward(ids, torch.arange(12, device="cuda")[None], pmask, 0, compiled=False)[:, -1]]
            tok = logits[-1].argmax(-1, keepdim=True)
            for step in range(12, 28):
                mask = torch.zeros(1, 1, 1, 64, dtype=torch.bool, device="cuda")
                mask[..., :step + 1] = True
                logits.append(rn.forward(tok, torch.tensor([[step]], device="cuda"), mask, step)[:, -1])
                tok = logits[-1].argmax(-1, keepdim=True)
            runs.append(torch.cat(logits))
    assert torch.equal(runs[0].argmax(-1), runs[1].argmax(-1))
    assert (runs[0] - runs[1]).abs().max() <= 0.05 * runs[0].abs().max()


def test_a_fused_layer_that_fails_to_build_warns_once_and_the_compiled_layer_runs(monkeypatch):
    from transformers import Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config("qwen2", vocab=96, layers=2, hidden=128)).eval().to(DEV)

    def broken(*args, **kwargs):
        raise RuntimeError("out of resource: shared memory")
    monkeypatch.setattr(qkv_rope, "qkv_rope", broken)
    tok, pos = torch.tensor([[5]], device=DEV), torch.tensor([[0]], device=DEV)
    mask = torch.zeros(1, 1, 1, 8, dtype=torch.bool, device=DEV)
    mask[..., 0] = True
    with torch.inference_mode():
        plain = NativeRunner(model, 8).forward(tok, pos, mask, 0)
        fused = NativeRunner(model, 8, kernels="layer")
        with pytest.warns(UserWarning, match="fused decode layer did not build"):
            first = fused.forward(tok, pos, mask, 0)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")           # tried once per model: no second warning
            second = fused.forward(tok, pos, mask, 0)
    torch.testing.assert_close(first, plain)
    torch.testing.assert_close(second, plain)


def test_paged_engine_single_request_on_the_fused_layer(monkeypatch):
    """One request decoding on the paged engine takes the fused layer for its one-token steps (K/V written at the
    step's slot of the paged cache) and gives the paged layer's greedy tokens."""
    from engine_models import tiny_lm
    from tilespec.engine.batching import BatchRequest
    from tilespec.engine.paged import model as paged_model
    from tilespec.engine.paged.engine import PagedEngine
    target = tiny_lm(0, logit_scale=3.0).to(DEV)
    target.generation_config.eos_token_id = None
    calls = []
    real = paged_model.paged_fused_layer
    monkeypatch.setattr(paged_model, "paged_fused_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for fused in (False, True):
        engine = PagedEngine(target, None, max_batch=2, block_size=4)
        engine.model.graphs = True           # the decode-step path (eager here: no CUDA graphs on the CPU)
        engine.model.fused = fused
        # 6 prompt tokens in blocks of 4: the decode steps write K/V into block 1's tail, then into block 2
        req = BatchRequest(prompt=[5, 6, 7, 8, 9, 10], max_tokens=5, seed=0, temperature=0.0)
        engine.submit(req)
        while engine.has_work:
            engine.step()
        out[fused] = list(req.tokens)
    assert len(out[True]) == 5 and out[True] == out[False]
    assert len(calls) >= 4 * target.config.num_hidden_layers     # every decode step after the prefill
