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
