"""The skinny fused linear kernel (engine/native/linear.py) against the PyTorch ops it replaces, in Triton's CPU
interpreter: every prologue / epilogue combination, fp32 (tight) and bf16 (rounding-level), ragged shapes."""
import pytest
import torch

from tilespec.engine.native import linear

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or linear._INTERPRET),
                                reason="needs CUDA or the Triton interpreter")


def _case(m, k, n, dtype, seed=0, silu_mul=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, m, k, generator=g).to(dtype)[0]
    w = (torch.randn(2 * n if silu_mul else n, k, generator=g) / k ** 0.5).to(dtype)
    return x, w, g


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (3, 96, 40), (17, 64, 16), (40, 80, 24)])
@pytest.mark.parametrize("parts", ["plain", "norm+bias", "residual", "norm+silu_mul", "silu_mul+residual"])
def test_fused_linear_matches_pytorch_fp32(m, k, n, parts):
    silu = "silu_mul" in parts
    x, w, g = _case(m, k, n, torch.float32, silu_mul=silu)
    kw = {}
    if "norm" in parts:
        kw["norm"], kw["eps"] = torch.rand(k, generator=g) + 0.5, 1e-6
    if "bias" in parts:
        kw["bias"] = torch.randn(n, generator=g)
    if "residual" in parts:
        kw["residual"] = torch.randn(m, n, generator=g)
    got = linear.fused_linear(x, w, silu_mul=silu, **kw)
    want = linear.fused_linear_reference(x, w, silu_mul=silu, **kw)
    assert got.shape == want.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("silu", [False, True])
def test_fused_linear_bf16_within_rounding(silu):
    x, w, g = _case(5, 128, 64, torch.bfloat16, seed=3, silu_mul=silu)
    norm = (torch.rand(128, generator=g) + 0.5).to(torch.bfloat16)
    res = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    got = linear.fused_linear(x, w, norm=norm, eps=1e-6, residual=res, silu_mul=silu)
    want = linear.fused_linear_reference(x, w, norm=norm, eps=1e-6, residual=res, silu_mul=silu)
    assert got.dtype == torch.bfloat16
    # same roundings in another summation order (and 1/sqrt vs rsqrt in the norm): a few bf16 steps apart at most
    # the fp32 tests above are the precise check; here the kernel must be as close to the exact (fp32) result as
    # the bf16 PyTorch ops are, within a bf16 step of the output's scale
    exact = linear.fused_linear_reference(x.float(), w.float(), norm=norm.float(), eps=1e-6, residual=res.float(),
                                          silu_mul=silu)
    err_kernel = (got.float() - exact).abs().max()
    err_torch = (want.float() - exact).abs().max()
    assert err_kernel <= 2 * err_torch + 2 ** -7 * exact.abs().max()


def test_leading_dims_kept_and_fallbacks():
    x, w, _ = _case(6, 64, 32, torch.float32)
    x3 = x.view(2, 3, 64)
    got = linear.fused_linear(x3, w)
    assert got.shape == (2, 3, 32)
    torch.testing.assert_close(got, torch.nn.functional.linear(x3, w), rtol=1e-5, atol=1e-5)
    big = torch.randn(linear.MAX_ROWS + 1, 64)
    assert not linear.can_run(big, w)             # prefill-sized: PyTorch
    torch.testing.assert_close(linear.fused_linear(big, w), torch.nn.functional.linear(big, w))
    assert not linear.can_run(x.double(), w)      # dtype mismatch: PyTorch decides (and errors as it would)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_layer_with_kernels_equals_pytorch_layer(family):
    """The native decoder with its projections (qwen2: q/k/v biases) and its attention on the kernels gives the
    PyTorch path's logits."""
    from engine_models import tiny_lm
    from tilespec.engine.native import NativeRunner
    from tilespec.engine.state import prefill_mask

    model = tiny_lm(5, family=family)
    ids = torch.tensor([[3, 9, 27, 81, 11, 5], [4, 4, 8, 15, 16, 23]])
    pos = torch.arange(6)[None].expand(2, 6)
    mask = prefill_mask(torch.ones(2, 6, dtype=torch.bool), 16)
    step_mask = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    step_mask[..., :7] = True
    outs = []
    with torch.inference_mode():
        for kernels in ("", "qkv,o,mlp", "all"):
            runner = NativeRunner(model, 16, kernels=kernels)
            prefill = runner.forward(ids, pos, mask, 0)
            step = runner.forward(torch.tensor([[42], [7]]), torch.tensor([[6], [6]]), step_mask, 6)
            outs.append((prefill, step))
    for variant in outs[1:]:
        for got, want in zip(variant, outs[0]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown kernel parts"):
        NativeRunner(model, 16, kernels="qkv,bogus").forward(ids, pos, mask, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_native_graphs_with_kernels_equal_eager_on_gpu(temperature, monkeypatch):
    """Every kernel part inside the compiled layer and the CUDA graphs (decode q=1, re-feed q=2, verify q=4)."""
    from engine_models import layer_skip, tiny_lm
    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine.native import runner as native_runner
    from tilespec.verify import SamplingParams

    monkeypatch.setenv("TILESPEC_NATIVE_KERNELS", "all")
    native_runner._COMPILED_LAYERS.clear()
    target = tiny_lm(21, family="qwen2", logit_scale=3.0).cuda()
    draft = layer_skip(target, 1).cuda()
    prompts = [[5, 17, 33, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [100, 3]]
    kwargs = dict(gamma=3, method="fused", sampling=SamplingParams(temperature=temperature), eos_token_id=-1,
                  pad_token_id=0)
    ref = SpeculativeDecoder(target, draft, compile="native", **kwargs).generate(input_ids=prompts,
                                                                                 max_new_tokens=16, seed=3)
    out = SpeculativeDecoder(target, draft, compile=True, **kwargs).generate(input_ids=prompts, max_new_tokens=16,
                                                                             seed=3)
    assert out.stats.runtime == "native-graphs"
    assert out.sequences == ref.sequences
    native_runner._COMPILED_LAYERS.clear()
