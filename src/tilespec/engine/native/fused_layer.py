"""One Llama-family decoder layer as tilespec's decode-shape Triton kernels only (no inductor): five launches.

Why: the compiled layer (inductor + cuBLAS + cuDNN) runs ~14 kernels per layer at decode shapes, several of them
~1-2 µs element-wise passes between GEMMs that are themselves latency-bound (``bench/results/forward-profile-*``).
Here the layer is: q/k/v with the residual add, norm, bias, RoPE and cache write (qkv_rope.py); attention (the
split-KV kernels where :func:`attention.preferred`, cuDNN SDPA elsewhere); the output projection with the residual
add; norm + gate/up + SiLU gate; the down projection (linear.py). Captured in the runner's CUDA graph like the
compiled layer, so launching from Python costs nothing at replay.

Same contract and residual-pair convention as :func:`llama.decoder_layer` (see there for shapes); rounding as
documented in qkv_rope.py and linear.py (equal to the PyTorch layer up to the GEMMs' summation order and the MLP
norm's rounding point). Only for ROWS rows and no tensor parallelism: :func:`can_run`.
"""
from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F

from . import linear, qkv_rope
from .attention import decode_attention_bqhd
from .attention import preferred as attention_preferred


# rows (B x q) the fused layer takes: one, a single request's decode step. At 5 and 8 rows its row-by-row
# multiply-add ran 3-5x slower than cuBLAS (bench/results/forward-profile-qwen1.5b-shape-h200.json, ``sweep``), so
# batches and verify chains keep the compiled layer
ROWS = 1


def can_run(h: torch.Tensor, qkv: torch.Tensor, gate_up: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            head_dim: int) -> bool:
    """True when every kernel of :func:`fused_decoder_layer` runs for these shapes (else keep the compiled layer)."""
    return (h.numel() // h.shape[-1] <= ROWS and qkv_rope.can_run(h, qkv, k_cache, v_cache, head_dim)
            and linear.can_run(h, gate_up))


_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # native decoder -> its kernels built and ran


def usable(native, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when the fused layer runs for this step of ``native`` (a NativeLlama): :func:`can_run` for its shapes,
    and its kernels built and ran on this device. They are tried once per model, on scratch buffers, outside any CUDA
    graph capture (the runner's eager warm-up comes first); a failure (a Triton compile error, too little shared
    memory on this GPU, ...) warns once and the model keeps the compiled layer, never crashing a step."""
    w = native.layers[0]
    if not can_run(h, w.qkv, w.gate_up, k_cache, v_cache, native.head_dim):
        return False
    built = _BUILT.get(native)
    if built is None:
        if h.is_cuda and torch.cuda.is_current_stream_capturing():
            return False                       # never try a build inside a capture: the next eager call will
        built = _BUILT[native] = _try_build(native, h, k_cache)
    return built


def _try_build(native, h: torch.Tensor, k_cache: torch.Tensor) -> bool:
    w = native.layers[0]
    d = h.shape[-1]
    x = torch.zeros((1, 1, d), dtype=h.dtype, device=h.device)
    cache = [torch.zeros((1, native.kv_heads, 16, native.head_dim), dtype=k_cache.dtype, device=h.device)
             for _ in range(2)]
    cos = torch.ones((1, 1, native.head_dim), dtype=torch.float32, device=h.device)
    mask = torch.zeros((1, 1, 1, 16), dtype=h.dtype, device=h.device)
    try:
        fused_decoder_layer(x, x, cos, cos * 0, mask, torch.zeros((), dtype=torch.int64, device=h.device), *cache,
                            w.ln1, w.qkv, w.qkv_bias, w.o, w.ln2, w.gate_up, w.down, heads=native.heads,
                            kv_heads=native.kv_heads, head_dim=native.head_dim, eps=native.eps)
        return True
    except Exception as err:   # noqa: BLE001 -- any build or launch failure: the compiled layer stays correct
        warnings.warn(f"tilespec's fused decode layer did not build or run on this device ({type(err).__name__}: "
                      f"{err}); one-row steps keep the compiled layer")
        return False


def fused_decoder_layer(h: torch.Tensor, res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                        write_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ln1: torch.Tensor,
                        qkv: torch.Tensor, qkv_bias, o: torch.Tensor, ln2: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, *, heads: int, kv_heads: int, head_dim: int, eps: float, **_unused
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, res) [B, q, d] -> (mlp output, residual) [B, q, d]; writes this layer's K/V at write_pos + [0, q)."""
    b, q, _ = h.shape
    res, xq = qkv_rope.qkv_rope(h, res, ln1, qkv, qkv_bias, cos, sin, k_cache, v_cache, write_pos, heads=heads,
                                kv_heads=kv_heads, head_dim=head_dim, eps=eps)
    if attention_preferred(xq, k_cache):
        attn = decode_attention_bqhd(xq, k_cache, v_cache, mask)                    # [B, q, H, D] contiguous
    else:
        attn = F.scaled_dot_product_attention(xq, k_cache, v_cache, attn_mask=mask,
                                              enable_gqa=heads != kv_heads).transpose(1, 2)
    attn = attn.reshape(b, q, heads * head_dim)
    res = linear.fused_linear(attn, o, residual=res)
    out = linear.fused_linear(linear.fused_linear(res, gate_up, norm=ln2, eps=eps, silu_mul=True), down)
    return out, res
