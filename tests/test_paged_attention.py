"""Paged attention (engine/paged/attention.py): the PyTorch reference against a dense float64 computation, and the
split-KV Triton kernel against the reference in Triton's CPU interpreter (mixed decode / verify / prefill batches,
GQA groups 1-6, random block tables, fp32 and bf16, one and several KV splits), the operator form, bad input and the
fallback. The ``gpu`` tests compare on CUDA at serving shapes, eagerly and replayed in a CUDA graph."""
import math
import warnings

import pytest
import torch

from tilespec.engine.paged import attention as pa

needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() or pa.triton_interpreted()) or not pa._TRITON,
                                  reason="needs Triton on CUDA or its interpreter")
MIXED = [(1, 40), (5, 21), (0, 9), (37, 70)]    # (new tokens, length after the step): decode, verify, pad, prefill


def make_inputs(seqs, h, hkv, d, bs=16, dtype=torch.float32, seed=0, device="cpu", spare_blocks=2):
    """Random q / paged caches for sequences [(n_s, kv_len_s)], each sequence's blocks drawn at random from a
    shuffled pool (block 0 never used), unused table entries 0. Returns the positional arguments of paged_attention."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-length // bs) for _, length in seqs) + spare_blocks
    pool = (torch.randperm(len(seqs) * max_blocks, generator=g) + 1).tolist()
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    for s, (_, length) in enumerate(seqs):
        used = -(-length // bs)
        tables[s, :used] = torch.tensor(pool[:used], dtype=torch.int32)
        pool = pool[used:]
    counts = torch.tensor([n for n, _ in seqs])
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).int()
    num_blocks = len(seqs) * max_blocks + 1
    q = torch.randn(int(counts.sum()), h, d, generator=g)
    k = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v = torch.randn(num_blocks, bs, hkv, d, generator=g)
    lens = torch.tensor([length for _, length in seqs], dtype=torch.int32)
    return tuple(x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
                 for x in (q, k, v, tables, cu_q, lens))


def dense_attention(q, k_cache, v_cache, tables, cu_q, lens, scale=None):
    """Every query row in float64 from positions mapped one by one to (block, offset), an explicit softmax."""
    t, h, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for s in range(len(lens)):
        a, b, length = int(cu_q[s]), int(cu_q[s + 1]), int(lens[s])
        pos = torch.arange(length)
        blocks = tables[s].long()[pos // bs]
        k = k_cache[blocks, pos % bs].double().repeat_interleave(h // hkv, dim=1)     # [L, H, D]
        v = v_cache[blocks, pos % bs].double().repeat_interleave(h // hkv, dim=1)
        last = length - (b - a) + torch.arange(b - a)                                  # each row's position
        scores = torch.einsum("jhd,lhd->jhl", q[a:b].double(), k) * scale
        scores = scores.masked_fill(pos[None, None, :] > last[:, None, None], float("-inf"))
        out[a:b] = torch.einsum("jhl,lhd->jhd", torch.softmax(scores, dim=2), v)
    return out


@pytest.mark.parametrize("h,hkv,d,bs", [(4, 2, 16, 16), (6, 1, 32, 8), (3, 3, 8, 4)])
def test_reference_matches_dense(h, hkv, d, bs):
    args = make_inputs(MIXED, h, hkv, d, bs=bs, seed=h)
    got = pa.paged_attention_reference(*args)
    assert got.shape == args[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), dense_attention(*args), rtol=1e-5, atol=1e-5)
    scaled = pa.paged_attention(*args, scale=0.3, kernel="torch")
    torch.testing.assert_close(scaled.double(), dense_attention(*args, scale=0.3), rtol=1e-5, atol=1e-5)


def test_reference_rows_past_the_sequences_are_zero_and_cpu_auto_is_the_reference():
    q, k, v, tables, cu_q, lens = make_inputs([(2, 5), (3, 30)], 4, 2, 16)
    q = torch.cat([q, torch.randn(3, 4, 16)])            # 3 padding rows owned by no sequence
    got = pa.paged_attention(q, k, v, tables, cu_q, lens)
    assert torch.equal(got[5:], torch.zeros(3, 4, 16))
    torch.testing.assert_close(got[:5], pa.paged_attention_reference(q[:5], k, v, tables, cu_q, lens))


def _kernel_vs_reference(monkeypatch, seqs, h, hkv, d, dtype, splits, max_q=None, tol=1e-5, seed=0):
    monkeypatch.setattr(pa, "SPLITS", splits)
    args = make_inputs(seqs, h, hkv, d, dtype=dtype, seed=seed)
    got = pa.paged_attention(*args, max_q=max_q, kernel="triton")
    assert not pa._KERNEL_FAILED, pa._KERNEL_FAILED              # the kernel ran (no silent fallback)
    want = pa.paged_attention_reference(*args)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    return got


@needs_kernel
@pytest.mark.parametrize("g,d,dtype,splits", [(1, 64, torch.float32, 1), (2, 128, torch.float32, 3),
                                              (4, 64, torch.float32, 2), (6, 64, torch.float32, 1),
                                              (6, 128, torch.bfloat16, 2), (2, 64, torch.bfloat16, 1)])
def test_kernel_mixed_batch(monkeypatch, g, d, dtype, splits):
    """A 1-token decode, a 5-token verify, a padding sequence and a 37-token prefill chunk after 33 cached tokens;
    contexts cross 16-slot blocks of a shuffled table."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    _kernel_vs_reference(monkeypatch, MIXED, g, 1, d, dtype, splits, tol=tol, seed=g)


@needs_kernel
def test_kernel_decode_batch_many_splits_and_gqa_heads(monkeypatch):
    """Single-token decodes over contexts ending on and after block edges; two KV heads; 3 splits (some empty for
    short contexts); max_q=1 tiles."""
    seqs = [(1, n) for n in (1, 16, 17, 150)]
    _kernel_vs_reference(monkeypatch, seqs, 8, 2, 64, torch.float32, 3, max_q=1, seed=3)


@needs_kernel
def test_kernel_padding_first_tiles_and_default_splits(monkeypatch):
    """A padding sequence first, a prefill spread over two tiles (max_q 24 -> 16-token tiles at G 6), D 80 (padded
    to 128 inside the kernel), the split count the module picks."""
    _kernel_vs_reference(monkeypatch, [(0, 4), (20, 20), (3, 50)], 6, 1, 80, torch.float32, None, max_q=24, seed=5)


@needs_kernel
def test_kernel_reads_q_views(monkeypatch):
    """q as the query part of a fused QKV projection's rows (row stride > H * D) and as a transposed view."""
    monkeypatch.setattr(pa, "SPLITS", 2)
    q, k, v, tables, cu_q, lens = make_inputs([(3, 40), (1, 9)], 4, 2, 32, seed=8)
    want = pa.paged_attention_reference(q, k, v, tables, cu_q, lens)
    qkv = torch.cat([q.flatten(1), torch.randn(4, 2 * 2 * 32)], dim=1)
    for view in (qkv[:, :128].view(4, 4, 32), q.transpose(1, 2).contiguous().transpose(1, 2)):
        assert not view.is_contiguous()
        got = pa.paged_attention(view, k, v, tables, cu_q, lens, kernel="triton")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_operator_form_for_compiled_code():
    args = make_inputs([(2, 20), (1, 7)], 2, 1, 32, seed=2)
    scale = 1 / math.sqrt(32)
    out = torch.ops.tilespec.paged_attention(*args, scale, 2)
    torch.testing.assert_close(out, pa.paged_attention_reference(*args), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(torch.ops.tilespec.paged_attention.default, (*args, scale, 2),
                          test_utils=("test_schema", "test_faketensor"))


@needs_kernel
def test_kernel_that_fails_to_build_falls_back_once_with_a_warning(monkeypatch):
    monkeypatch.setattr(pa, "_KERNEL_FAILED", [])

    def broken(*a, **kw):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(pa, "_launch", broken)
    args = make_inputs([(2, 20)], 4, 2, 32)
    with pytest.warns(UserWarning, match="no compiler"):
        got = pa.paged_attention(*args, kernel="triton")
    torch.testing.assert_close(got, pa.paged_attention_reference(*args))
    assert not pa.kernel_takes(*args[:3])
    with warnings.catch_warnings():
        warnings.simplefilter("error")                               # warned once only
        pa.paged_attention(*args, kernel="triton")


def test_bad_input_gets_a_clear_error():
    q, k, v, tables, cu_q, lens = make_inputs([(2, 20), (1, 7)], 4, 2, 32)
    with pytest.raises(ValueError, match="multiple"):
        pa.paged_attention(q[:, :3], k, v, tables, cu_q, lens)
    with pytest.raises(ValueError, match="head dim"):
        pa.paged_attention(q[..., :16], k, v, tables, cu_q, lens)
    with pytest.raises(ValueError, match="v_cache"):
        pa.paged_attention(q, k, v[:, :8], tables, cu_q, lens)
    with pytest.raises(TypeError, match="share"):
        pa.paged_attention(q, k.double(), v.double(), tables, cu_q, lens)
    with pytest.raises(TypeError, match="int32"):
        pa.paged_attention(q, k, v, tables.long(), cu_q, lens)
    with pytest.raises(ValueError, match="cu_q"):
        pa.paged_attention(q, k, v, tables, cu_q[:2], lens)
    with pytest.raises(ValueError, match="max_q"):
        pa.paged_attention(q, k, v, tables, cu_q, lens, max_q=0)
    with pytest.raises(ValueError, match="kernel"):
        pa.paged_attention(q, k, v, tables, cu_q, lens, kernel="cuda")
    with pytest.raises(ValueError, match="inconsistent"):         # kv_len below the sequence's new tokens
        pa.paged_attention(q, k, v, tables, cu_q, torch.tensor([1, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match="inconsistent"):         # more tokens than max_q promised
        pa.paged_attention(q, k, v, tables, cu_q, lens, max_q=1, kernel="torch")


@needs_kernel
def test_kernel_refuses_a_block_size_that_is_not_a_power_of_two():
    q, k, v, tables, cu_q, lens = make_inputs([(2, 20)], 4, 2, 32, bs=12)
    with pytest.raises(ValueError, match="power of two"):
        pa.paged_attention(q, k, v, tables, cu_q, lens, kernel="triton")
    torch.testing.assert_close(pa.paged_attention(q, k, v, tables, cu_q, lens, kernel="torch").double(),
                               dense_attention(q, k, v, tables, cu_q, lens), rtol=1e-5, atol=1e-5)


def test_split_and_tile_choices():
    assert pa.splits_for(2, 2048, 132) == 16                       # B=1 decode, 2k capacity: capped by keys
    assert pa.splits_for(2, 1 << 16, 132) == pa.MAX_SPLITS
    assert pa.splits_for(32, 1 << 16, 132) == 9                     # about two waves
    assert pa.splits_for(132, 1 << 16, 132) == 1 and pa.splits_for(4, 64, 132) == 1
    assert pa.tile_shape(6, 1) == (2, 8) and pa.tile_shape(6, 512) == (16, 8)   # rows >= 16, <= MAX_ROWS
    assert pa.tile_shape(1, 5) == (16, 1) and pa.tile_shape(2, 5) == (8, 2)


# ------------------------------------------------------------------------------------------------ GPU
def _gpu_case(seqs, dtype, splits=None):
    args = make_inputs(seqs, 12, 2, 128, dtype=dtype, device="cuda", seed=11)
    pa.SPLITS = splits
    try:
        got = pa.paged_attention(*args, max_q=max(n for n, _ in seqs))
    finally:
        pa.SPLITS = None
    want = pa.paged_attention_reference(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    return args


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_serving_shapes(dtype):
    """64 sequences verifying 5 tokens over 2k contexts; one 512-token prefill chunk after 1,000 cached tokens
    beside 7 decodes; B = 1 decode over 2k (split-KV); each with the module's splits and forced 1 / 4."""
    for seqs in ([(5, 2000 + 7 * i) for i in range(64)], [(512, 1512)] + [(1, 300 + 100 * i) for i in range(7)],
                 [(1, 2048)]):
        for splits in (None, 1, 4):
            _gpu_case(seqs, dtype, splits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_inside_torch_compile():
    """Compiled callers get the opaque operator (fullgraph: no graph break) and the same result."""
    args = make_inputs([(5, 700), (1, 33), (5, 90)], 12, 2, 128, dtype=torch.bfloat16, device="cuda", seed=4)
    compiled = torch.compile(lambda *a: pa.paged_attention(*a, max_q=5) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(*args), pa.paged_attention(*args, max_q=5) * 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_replay_follows_new_metadata():
    """Captured once, replayed after the lengths and block tables changed in place: the grid depends on shapes
    only, so the replay reads the new values."""
    args = make_inputs([(5, 900), (1, 40), (0, 3), (5, 1200)], 12, 2, 128, dtype=torch.bfloat16, device="cuda")
    q, k, v, tables, cu_q, lens = args
    fn = lambda: pa.paged_attention(q, k, v, tables, cu_q, lens, max_q=5)   # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    lens.copy_(torch.tensor([700, 41, 3, 1230], dtype=torch.int32))
    cu_q.copy_(torch.tensor([0, 5, 5, 6, 11], dtype=torch.int32))   # second sequence now pads, third decodes
    tables.copy_(tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:11].float(), pa.paged_attention_reference(*args)[:11].float(),
                               rtol=2e-2, atol=2e-2)


class _Recorder:
    """Stands in for a Triton kernel: records each launch's arguments by name (nothing runs)."""

    def __init__(self, kernel):
        self.kernel, self.names, self.launches = kernel, kernel.arg_names, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(dict(zip(self.names, args), **kwargs))
        return launch


def _recorded(monkeypatch):
    partial, merge = _Recorder(pa._partial_kernel), _Recorder(pa._merge_kernel)
    monkeypatch.setattr(pa, "_partial_kernel", partial)
    monkeypatch.setattr(pa, "_merge_kernel", merge)
    monkeypatch.setattr(pa, "_sm_count", lambda device: 132)
    return partial, merge


def _key(launch: dict) -> tuple:
    return launch["BLOCK_M"], launch["SP"], launch["SINGLE"], launch["num_warps"]


@pytest.mark.skipif(not pa._TRITON, reason="needs Triton")
def test_every_served_launch_is_a_listed_variant_and_varying_ints_are_not_specialised(monkeypatch):
    """Why a served step never compiles the kernel: over random mixed and decode steps (sequence counts, token counts,
    table widths, context lengths) every launch's compile key is one of ``variants()`` -- which the warm-up launches
    -- and every int argument whose value changes between launches is one Triton does not specialise (an int equal
    to 1 or divisible by 16 would otherwise compile a new kernel in the middle of serving)."""
    import random
    heads, kv_heads, d, max_seqs, max_q = 12, 2, 128, 256, 2048
    partial, merge = _recorded(monkeypatch)
    rng = random.Random(0)
    for _ in range(300):
        s = rng.choice([1, 2, 3, 15, 16, 17, 63, 64, 65, 200, 256])
        counts = [rng.choice([0, 1, 1, 1, 5, 16, 300]) for _ in range(s)]
        mq = max(1, max(counts))
        t = sum(counts) + rng.choice([0, 0, 7])                 # trailing padding tokens
        m = rng.choice([1, 3, 16, 17, 64, 128])
        q = torch.zeros(max(t, 1), heads, d, dtype=torch.bfloat16)
        k = torch.zeros(4, 16, kv_heads, d, dtype=torch.bfloat16)
        cu = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).int()
        pa._launch(q, k, k, torch.zeros(s, m, dtype=torch.int32), cu, torch.tensor(counts, dtype=torch.int32),
                   0.1, mq)
    listed = pa.variants(heads, kv_heads, d, max_seqs, max_q)
    assert {_key(x) for x in partial.launches} <= listed
    assert any(not x["SINGLE"] for x in partial.launches) and merge.launches

    for recorder in (partial, merge):
        runtime = _runtime_params(recorder.kernel)
        varying = {n for n in runtime if len({x[n] for x in recorder.launches if isinstance(x[n], int)}) > 1}
        assert varying <= _unspecialised(recorder.kernel), varying
    # the warm-up launches exactly the listed variants
    partial.launches.clear()
    k = torch.zeros(4, 16, kv_heads, d, dtype=torch.bfloat16)
    monkeypatch.setattr(pa, "kernel_takes", lambda *a: True)
    assert pa.warm_variants(torch.bfloat16, k, k, heads, max_seqs, max_q) == len(listed)
    assert {_key(x) for x in partial.launches} == listed


def _runtime_params(kernel) -> list:
    """The kernel's parameters that are not constexprs (Triton may specialise their int values)."""
    import inspect
    return [n for n, p in inspect.signature(kernel.fn).parameters.items() if "constexpr" not in str(p.annotation)]


def _unspecialised(kernel) -> set:
    """Its do_not_specialize names (a JITFunction keeps them; the interpreter's function in its kwargs)."""
    names = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
    return set(names or ())


@pytest.mark.skipif(not pa._TRITON, reason="needs Triton")
def test_triton_does_not_specialise_the_step_varying_ints():
    """The kernels' declarations: S, NS (and the block-table stride) are not specialised."""
    assert _unspecialised(pa._partial_kernel) == {"S", "NS", "sbt"}
    assert _unspecialised(pa._merge_kernel) == {"S", "NS"}


def test_out_buffer_is_checked_and_filled_on_the_sequences_rows():
    q, k, v, tables, cu_q, lens = make_inputs([(2, 5), (3, 30)], 4, 2, 16)
    with pytest.raises(ValueError, match="out must be"):
        pa.paged_attention(q, k, v, tables, cu_q, lens, out=torch.zeros(2, 4, 16))
    out = torch.full((7, 4, 16), 7.0)
    got = pa.paged_attention(torch.cat([q, torch.zeros(2, 4, 16)]), k, v, tables, cu_q, lens, out=out)
    assert got is out and torch.equal(out[5:], torch.full((2, 4, 16), 7.0))     # rows past the sequences kept
    torch.testing.assert_close(out[:5], pa.paged_attention_reference(q, k, v, tables, cu_q, lens))
