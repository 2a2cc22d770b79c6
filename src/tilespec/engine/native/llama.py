"""A compact Llama-family decoder (Llama, Qwen2, Mistral, SmolLM2) over the weights of a loaded transformers model.

Why: a CUDA-graph replay of the transformers modules is bound by ~40 small kernels per layer (4.3 ms for a 1.5B
forward against a 1.2 ms HBM floor). This decoder runs one layer as one function of plain tensors (fused q/k/v and
gate/up weights), which ``torch.compile`` compiles once and every layer reuses (the layers differ only in their
weights), so inductor fuses the norms, RoPE, the cache write and the activation, and the whole forward is then
captured in one CUDA graph by the runner.

Shapes: tokens/positions [B, q] int64; ``mask`` bool [B, 1, q, C] (True = attend; the layers get it as an additive
mask in the model dtype, 0 or finfo.min, never -inf, so fully masked padding rows stay finite); K/V caches [B, H_kv, C, D] per layer; the q new
states are written at slots ``write_pos + [0, q)`` (``write_pos`` a 0-d int64 device tensor, so a captured graph
reads it without recapture). Logits [B, q, V] in the model dtype.

Weights are shared with the transformers model (the fused q/k/v and gate/up tensors replace its projection weights
by views), so memory is not doubled and the transformers model keeps working.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

from tilespec import settings

from . import fused_layer
from .attention import decode_attention_bqhd
from .attention import preferred as attention_preferred
from .linear import fused_linear

SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@lru_cache(maxsize=16)
def sdpa_backends(spec: str) -> tuple:
    """"efficient,cudnn" -> (SDPBackend, ...) ("" -> (), i.e. PyTorch's own choice). Env TILESPEC_SDPA picks the
    attention backends of the native forwards (compiled code bakes the choice in when it is traced). Cached: every
    forward asks."""
    names = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part not in names:
            raise ValueError(f"unknown SDPA backend {part!r}; choose from {sorted(names)}")
        out.append(names[part])
    return tuple(out)


def unsupported_reason(model) -> str | None:
    """None when :class:`NativeLlama` can run ``model``; otherwise why not (the runner then keeps transformers)."""
    name = type(model).__name__
    if name not in SUPPORTED:
        return f"{name} is not one of {', '.join(SUPPORTED)}"
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r} (only silu)"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", name == "MistralForCausalLM"):
        return "sliding-window attention"
    rope = getattr(cfg, "rope_scaling", None) or {}
    if (rope.get("rope_type") or rope.get("type")) in ("dynamic", "longrope"):
        return f"RoPE type {rope.get('rope_type') or rope.get('type')!r} changes with the sequence length"
    if getattr(cfg, "mlp_bias", False):
        return "MLP biases"
    if any(layer.self_attn.o_proj.bias is not None for layer in model.model.layers):
        return "output-projection biases"
    return None


@dataclass
class LayerWeights:
    """One decoder layer: qkv [(H + 2 H_kv) D, d] (+ bias or None), o [d, H D], gate_up [2 F, d], down [d, F]."""

    ln1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@torch.inference_mode(False)
@torch.no_grad()
def _fuse(linears: list, dim: int = 0) -> torch.Tensor:
    """Concatenate the weights of ``linears`` and make each module's weight a view into the result. Made outside
    inference mode (the first forward runs inside it): the model's parameters stay ordinary tensors, so the model can
    still be trained after it decoded (its training updates the fused tensor through the views)."""
    fused = torch.cat([m.weight.data for m in linears], dim=dim)
    start = 0
    for m in linears:
        n = m.weight.shape[dim]
        m.weight.data = fused.narrow(dim, start, n)
        start += n
    return fused


@torch.inference_mode(False)
@torch.no_grad()
def _fuse_bias(linears: list) -> torch.Tensor | None:
    if all(getattr(m, "bias", None) is None for m in linears):
        return None
    parts = [m.bias.data if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in linears]
    fused = torch.cat(parts)
    start = 0
    for m in linears:
        n = m.weight.shape[0]
        if m.bias is not None:
            m.bias.data = fused.narrow(0, start, n)
        start += n
    return fused


def _layer_weights(layer) -> LayerWeights:
    """The fused weights of one transformers decoder layer, made once per layer module (a layer-skip draft shares
    the target's layer modules, hence its fused tensors too)."""
    cached = getattr(layer, "_tilespec_fused", None)
    if cached is None:
        at, mlp = layer.self_attn, layer.mlp
        cached = LayerWeights(
            ln1=layer.input_layernorm.weight, qkv=_fuse([at.q_proj, at.k_proj, at.v_proj]),
            qkv_bias=_fuse_bias([at.q_proj, at.k_proj, at.v_proj]), o=at.o_proj.weight,
            ln2=layer.post_attention_layernorm.weight, gate_up=_fuse([mlp.gate_proj, mlp.up_proj]),
            down=mlp.down_proj.weight)
        layer._tilespec_fused = cached
    return cached


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, cast back (as transformers' LlamaRMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def decoder_layer(h: torch.Tensor, res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                  write_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ln1: torch.Tensor,
                  qkv: torch.Tensor, qkv_bias: torch.Tensor | None, o: torch.Tensor, ln2: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, *, heads: int, kv_heads: int, head_dim: int, eps: float,
                  flex: bool = False, kernels: str = "", reduce=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm decoder layer; writes its K/V at slots write_pos + [0, q).

    The residual stream is carried as a pair (h, res) [B, q, d] whose sum is transformers' hidden state: the layer
    adds them first (the previous layer's MLP output onto its residual: the same bf16 add transformers does at the
    end of that layer), so inductor fuses the add into this layer's RMSNorm instead of launching it on its own.
    Returns (mlp output, residual) for the next layer. The first layer gets (embeddings, zeros).
    ``flex``: attention through FlexAttention (compiled paths only: inductor's decoding kernel) instead of SDPA.
    ``kernels``: comma-separated parts that run tilespec's decode-shape Triton kernels instead of PyTorch ops
    (``linear.fused_linear``; ``attention.decode_attention``): "qkv" (norm + q/k/v + bias), "o" (output projection +
    residual), "mlp" (norm + gate/up + SiLU gate; down projection), "attn", or "all". Same maths, one launch per
    part; each falls back to PyTorch where its kernel cannot run (e.g. prefill-sized M).
    ``reduce``: tensor parallelism (tensor_parallel.py): the weights are this rank's shards (local heads, MLP
    columns) and ``reduce`` sums the output and down projections' partial results over the ranks."""
    b, q, _ = h.shape
    parts = _parts(kernels)
    res = h + res
    if "qkv" in parts:
        proj = fused_linear(res, qkv, bias=qkv_bias, norm=ln1, eps=eps)
    else:
        proj = F.linear(rms_norm(res, ln1, eps), qkv, qkv_bias)
    nq, nkv = heads * head_dim, kv_heads * head_dim
    xq = proj[..., :nq].view(b, q, heads, head_dim).transpose(1, 2)
    xk = proj[..., nq:nq + nkv].view(b, q, kv_heads, head_dim).transpose(1, 2)
    xv = proj[..., nq + nkv:].view(b, q, kv_heads, head_dim).transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]                                  # [B, 1, q, D]
    xq = (xq * cos + _rotate_half(xq) * sin).to(h.dtype)
    xk = (xk * cos + _rotate_half(xk) * sin).to(h.dtype)
    slots = write_pos + torch.arange(q, device=h.device)
    k_cache.index_copy_(2, slots, xk)
    v_cache.index_copy_(2, slots, xv)
    if "attn" in parts and attention_preferred(xq, k_cache):
        attn = decode_attention_bqhd(xq, k_cache, v_cache, mask).transpose(1, 2)   # a view: no copy below
    elif flex:
        def add_mask(score, bi, hi, qi, kvi):
            return score + mask[bi, 0, qi, kvi]
        attn = flex_attention(xq, k_cache, v_cache, score_mod=add_mask, enable_gqa=heads != kv_heads)
    else:
        attn = F.scaled_dot_product_attention(xq, k_cache, v_cache, attn_mask=mask, enable_gqa=heads != kv_heads)
    attn = attn.transpose(1, 2).reshape(b, q, nq)
    if reduce is not None:       # a partial sum per rank: the residual is added once, after the sum
        res = res + reduce(fused_linear(attn, o) if "o" in parts else F.linear(attn, o))
    else:
        res = fused_linear(attn, o, residual=res) if "o" in parts else res + F.linear(attn, o)
    if "mlp" in parts:
        out = fused_linear(fused_linear(res, gate_up, norm=ln2, eps=eps, silu_mul=True), down)
    else:
        gu = F.linear(rms_norm(res, ln2, eps), gate_up)
        f = gu.shape[-1] // 2
        out = F.linear(F.silu(gu[..., :f]) * gu[..., f:], down)
    return (out if reduce is None else reduce(out)), res


def prologue(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, embed: torch.Tensor,
             inv_freq: torch.Tensor, rope_scale: float) -> tuple:
    """tokens/positions [B, q] int64, bool mask [B, 1, q, C] -> (h, res) [B, q, d] (embeddings, zeros), cos / sin
    [B, q, D] fp32 (transformers' RoPE convention: halves, not interleaved) and the additive mask [B, 1, q, C] in the
    model dtype (0 = attend, finfo.min = masked; never -inf, so fully masked padding rows stay finite)."""
    h = F.embedding(tokens, embed)
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return h, torch.zeros_like(h), emb.cos() * rope_scale, emb.sin() * rope_scale, additive_mask(mask, embed.dtype)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = attend) -> additive mask in ``dtype``: 0 or finfo.min (never -inf)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)


def head(h: torch.Tensor, res: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, eps: float,
         keep: int | None = None) -> torch.Tensor:
    """The last layer's (h, res) -> logits [B, q or keep, V] (model dtype): final add, RMSNorm, LM head."""
    if keep is not None:
        h, res = h[:, -keep:], res[:, -keep:]
    return F.linear(rms_norm(h + res, norm, eps), lm_head)


# "compact": a token tree's K/V moves (native/slot_moves.py); "layer": the whole layer as tilespec's kernels
# (fused_layer.py) wherever they all run, else the parts named beside it
KERNEL_PARTS = ("qkv", "o", "mlp", "attn", "compact", "layer")


def _parts(kernels: str) -> tuple:
    """The parts named in a ``kernels`` string ("" = none, "all" = every part of KERNEL_PARTS)."""
    names = tuple(p.strip() for p in kernels.split(",") if p.strip())
    if "all" in names:
        return KERNEL_PARTS
    unknown = [p for p in names if p not in KERNEL_PARTS]
    if unknown:
        raise ValueError(f"unknown kernel parts {unknown}; choose from {KERNEL_PARTS} or 'all'")
    return names


class NativeLlama:
    """The decoder of a transformers Llama-family causal LM as plain-tensor functions (see the module docstring).

    :meth:`forward` runs ``layer_fn`` (:func:`decoder_layer` or a compiled copy of it) over the layers, with the
    embedding, RoPE table, final norm and LM head around it, on caches from :meth:`new_caches`.
    """

    encoder_decoder = False

    def __init__(self, model):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no native path for this model: {reason}")
        cfg = model.config
        inner = model.model
        self.model = model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = float(cfg.rms_norm_eps)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.get_output_embeddings().weight
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scale = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        self.layers = [_layer_weights(layer) for layer in inner.layers]
        self.dtype = self.embed.dtype

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def new_caches(self, batch: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed (K, V) buffers [B, H_kv, C, D] per layer (zeros: unwritten slots stay finite under the mask)."""
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        dev = self.embed.device
        return [(torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
                for _ in self.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write_pos: torch.Tensor,
                caches: list, keep: int | None = None, layer_fn=decoder_layer, prologue_fn=prologue, head_fn=head,
                capture: tuple = (), **layer_kw):
        """tokens/positions [B, q], bool mask [B, 1, q, C] -> logits [B, q or keep, V] (model dtype).
        ``layer_fn`` / ``prologue_fn`` / ``head_fn``: :func:`decoder_layer`, :func:`prologue`, :func:`head` or
        compiled copies of them (the runner's compiled paths). ``capture``: hidden-state indices (transformers'
        ``hidden_states`` numbering: i = output of layer i - 1, 1 <= i < L) -> returns (logits, features
        [B, q, len(capture) * d]) with every position's features, for a draft head."""
        h, res, cos, sin, additive = prologue_fn(tokens, positions, mask, self.embed, self.inv_freq, self.rope_scale)
        if (caches and "layer" in _parts(layer_kw.get("kernels", "")) and layer_kw.get("reduce") is None
                and fused_layer.usable(self, h, *caches[0][:2])):
            layer_fn = fused_layer.fused_decoder_layer
        feats = {}
        backends = sdpa_backends(settings.get().sdpa)
        with sdpa_kernel(list(backends)) if backends else nullcontext():
            for i, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
                h, res = layer_fn(h, res, cos, sin, additive, write_pos, k_cache, v_cache, w.ln1, w.qkv, w.qkv_bias,
                                  w.o, w.ln2, w.gate_up, w.down, heads=self.heads, kv_heads=self.kv_heads,
                                  head_dim=self.head_dim, eps=self.eps, **layer_kw)
                if i + 1 in capture:
                    feats[i + 1] = h + res
        logits = head_fn(h, res, self.norm, self.lm_head, self.eps, keep)
        if not capture:
            return logits
        return logits, torch.cat([feats[i] for i in capture], dim=-1)


NativeLlama.layer = staticmethod(decoder_layer)
NativeLlama.prologue = staticmethod(prologue)
NativeLlama.head = staticmethod(head)
