"""verify/wide_rows.py: the chunked reductions equal torch's one-pass ops (ties, -inf, tails, few and many rows)."""
import pytest
import torch

from tilespec.verify import wide_rows
from tilespec.verify.wide_rows import CHUNK

WIDTHS = [7, CHUNK, CHUNK + 1, 3 * CHUNK - 5, 151_936]


def _rows(v: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, v, generator=g)
    x[0, 0, -1] = 50.0                      # the maximum in the padded tail chunk
    x[0, 1] = -float("inf")                 # a row of -inf
    x[0, 2, v // 2:] = -float("inf")
    x[1, 0] = torch.round(x[1, 0])          # many exact ties
    x[1, 1, :] = 1.0                        # all tied: the first index wins
    return x.to(dtype)


@pytest.mark.parametrize("v", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_the_first_maximum(v, dtype):
    x = _rows(v, dtype=dtype)
    assert torch.equal(wide_rows.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("v", WIDTHS)
@pytest.mark.parametrize("k", [1, 8, 10])
def test_topk_values_equal_torch(v, k):
    x = _rows(v, seed=1)
    k = min(k, v)
    top, idx = wide_rows.topk(x, k)
    ref, _ = x.topk(k, dim=-1)
    assert torch.equal(top, ref)
    assert idx.min() >= 0 and idx.max() < v
    finite = torch.isfinite(top)
    assert torch.equal(x.gather(-1, idx)[finite], top[finite])   # the indices hold those values


@pytest.mark.parametrize("v", WIDTHS)
def test_logsumexp_and_log_softmax_match_torch(v):
    x = _rows(v, seed=2) * 7
    x[2, 3, 0] = float("inf")
    ref = torch.logsumexp(x, dim=-1)
    got = wide_rows.logsumexp(x)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-6, equal_nan=True)
    assert got[0, 1] == -float("inf") and got[2, 3] == float("inf")
    ok = torch.isfinite(ref)
    assert torch.allclose(wide_rows.log_softmax(x)[ok], torch.log_softmax(x, dim=-1)[ok], atol=1e-5)


@pytest.mark.parametrize("v,k", [(CHUNK * 2 + 1, 8), (5 * CHUNK - 3, 16), (32_000, 8), (CHUNK * 3, 1)])
def test_row_topk_kernel_equals_torch_topk(v, k):
    """The Triton kernel (interpreter on CPU): torch.topk's values, distinct indices that hold them, ties lowest
    index first, -inf rows and short rows included."""
    x = _rows(v, seed=3)
    x[2, 0, 3:] = -float("inf")              # fewer than k finite entries
    vals, idx = torch.ops.tilespec.row_topk(x, k)
    assert torch.equal(vals, x.topk(k, dim=-1).values)
    assert idx.dtype == torch.int64 and idx.min() >= 0 and idx.max() < v
    assert torch.equal(x.gather(-1, idx), vals)
    s = idx.sort(dim=-1).values
    assert (s[..., 1:] != s[..., :-1]).all()
    tied = idx[1, 1]                          # a row of equal values: the first k indices, in order
    assert torch.equal(tied, torch.arange(k))


def test_topk_refuses_a_k_outside_the_row():
    x = torch.zeros(2, 100)
    for k in (0, 101, 2.0, True):
        with pytest.raises(ValueError, match="int k in \\[1, 100\\]"):
            wide_rows.topk(x, k)


def test_row_topk_kernel_takes_only_what_it_supports():
    wide = torch.zeros(2, 32_000)
    assert wide_rows.kernel_takes(wide, 8) and wide_rows.kernel_takes(wide.bfloat16(), 16)
    assert not wide_rows.kernel_takes(wide, 17)                 # k above MAX_K
    assert not wide_rows.kernel_takes(torch.zeros(2, 100), 8)   # narrow rows: torch.topk
    assert not wide_rows.kernel_takes(wide.double(), 8)
    assert not wide_rows.kernel_takes(torch.zeros(1, 2_000_000), 16)   # candidates beyond the second launch


def test_a_failing_row_topk_kernel_falls_back_to_torch(monkeypatch):
    import tilespec.verify.kernels.row_topk as kernel

    def broken(x, k):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(kernel, "launch", broken)
    monkeypatch.setattr(wide_rows, "_KERNEL_FAILED", [])
    x = _rows(32_000, seed=4)
    with pytest.warns(UserWarning, match="row top-k kernel failed"):
        vals, _ = torch.ops.tilespec.row_topk(x, 8)
    assert torch.equal(vals, x.topk(8, dim=-1).values)
    assert wide_rows._KERNEL_FAILED and not wide_rows.kernel_takes(x, 8)


def test_row_topk_operator_traces_whole_in_a_compiled_region():
    """The frontier's compiled regions (engine/fused.py) call the kernel through this opaque operator."""
    x = _rows(5 * CHUNK, seed=5)
    f = torch.compile(lambda t: torch.ops.tilespec.row_topk(t * 2, 4), backend="aot_eager", fullgraph=True)
    vals, idx = f(x)
    assert torch.equal(vals, (x * 2).topk(4, dim=-1).values)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_topk_kernel_on_the_gpu_equals_torch_and_replays_in_a_graph(dtype):
    """The kernel compiled for the GPU (not the interpreter): torch.topk's values, and the same inside a CUDA graph."""
    x = torch.randn(2, 8, 32_000, device="cuda").to(dtype)
    vals, idx = wide_rows.topk(x, 8)
    assert not wide_rows._KERNEL_FAILED
    assert torch.equal(vals, x.topk(8, dim=-1).values) and torch.equal(x.gather(-1, idx), vals)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_vals, g_idx = wide_rows.topk(x, 8)
    x.copy_(torch.randn_like(x.float()).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_vals, x.topk(8, dim=-1).values) and torch.equal(x.gather(-1, g_idx), g_vals)
