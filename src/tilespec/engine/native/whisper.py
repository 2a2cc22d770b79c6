"""A compact Whisper decoder over the weights of a loaded transformers ``WhisperForConditionalGeneration``.

Same design as llama.py: one layer function of plain tensors (fused self-attention q/k/v), compiled once and
shared by the layers, the whole decoder forward captured in one CUDA graph by the runner. The encoder stays the
transformers module and runs once per generation; :meth:`NativeWhisperDecoder.cross_states` projects its output to
each layer's cross-attention K/V once, so a decode step reads them and never recomputes them.

Shapes: tokens/positions [B, q]; additive self-attention mask [B, 1, q, C]; per layer the cache tuple
(K, V) [B, H, C, D] for self-attention plus (K_x, V_x) [B, H, T_enc, D] for cross-attention; logits [B, q, V].
Learned positions are indexed by the explicit ``positions`` (holes in the slot cache do not shift them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .llama import _fuse, _fuse_bias, additive_mask


def whisper_unsupported_reason(model) -> str | None:
    if type(model).__name__ != "WhisperForConditionalGeneration":
        return f"{type(model).__name__} is not WhisperForConditionalGeneration"
    cfg = model.config
    if cfg.activation_function != "gelu":
        return f"activation {cfg.activation_function!r} (only gelu)"
    if getattr(cfg, "scale_embedding", False):
        return "scaled embeddings"
    return None


@dataclass
class WhisperLayerWeights:
    """LayerNorms (weight, bias); self-attention qkv [3d, d] + bias (zeros for k); cross q [d, d]; outputs; MLP."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    o_w: torch.Tensor
    o_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    cq_w: torch.Tensor
    cq_b: torch.Tensor
    co_w: torch.Tensor
    co_b: torch.Tensor
    ln3_w: torch.Tensor
    ln3_b: torch.Tensor
    fc1_w: torch.Tensor
    fc1_b: torch.Tensor
    fc2_w: torch.Tensor
    fc2_b: torch.Tensor


def _layer_weights(layer) -> WhisperLayerWeights:
    cached = getattr(layer, "_tilespec_fused", None)
    if cached is None:
        at, x = layer.self_attn, layer.encoder_attn
        cached = WhisperLayerWeights(
            ln1_w=layer.self_attn_layer_norm.weight, ln1_b=layer.self_attn_layer_norm.bias,
            qkv_w=_fuse([at.q_proj, at.k_proj, at.v_proj]), qkv_b=_fuse_bias([at.q_proj, at.k_proj, at.v_proj]),
            o_w=at.out_proj.weight, o_b=at.out_proj.bias,
            ln2_w=layer.encoder_attn_layer_norm.weight, ln2_b=layer.encoder_attn_layer_norm.bias,
            cq_w=x.q_proj.weight, cq_b=x.q_proj.bias, co_w=x.out_proj.weight, co_b=x.out_proj.bias,
            ln3_w=layer.final_layer_norm.weight, ln3_b=layer.final_layer_norm.bias,
            fc1_w=layer.fc1.weight, fc1_b=layer.fc1.bias, fc2_w=layer.fc2.weight, fc2_b=layer.fc2.bias)
        layer._tilespec_fused = cached
    return cached


def whisper_layer(h, mask, write_pos, k_cache, v_cache, cross_k, cross_v, ln1_w, ln1_b, qkv_w, qkv_b, o_w, o_b,
                  ln2_w, ln2_b, cq_w, cq_b, co_w, co_b, ln3_w, ln3_b, fc1_w, fc1_b, fc2_w, fc2_b, *,
                  heads: int, head_dim: int, eps: float, flex: bool = False):
    """One Whisper decoder layer on h [B, q, d]; writes its self-attention K/V at slots write_pos + [0, q)."""
    b, q, d = h.shape
    x = F.layer_norm(h, (d,), ln1_w, ln1_b, eps)
    proj = F.linear(x, qkv_w, qkv_b).view(b, q, 3, heads, head_dim)
    xq, xk, xv = (proj[:, :, i].transpose(1, 2) for i in range(3))
    slots = write_pos + torch.arange(q, device=h.device)
    k_cache.index_copy_(2, slots, xk)
    v_cache.index_copy_(2, slots, xv)
    attn = F.scaled_dot_product_attention(xq, k_cache, v_cache, attn_mask=mask)
    h = h + F.linear(attn.transpose(1, 2).reshape(b, q, d), o_w, o_b)
    x = F.layer_norm(h, (d,), ln2_w, ln2_b, eps)
    cq = F.linear(x, cq_w, cq_b).view(b, q, heads, head_dim).transpose(1, 2)
    attn = F.scaled_dot_product_attention(cq, cross_k, cross_v)
    h = h + F.linear(attn.transpose(1, 2).reshape(b, q, d), co_w, co_b)
    x = F.layer_norm(h, (d,), ln3_w, ln3_b, eps)
    return h + F.linear(F.gelu(F.linear(x, fc1_w, fc1_b)), fc2_w, fc2_b)


class NativeWhisperDecoder:
    """The decoder of a transformers Whisper model as plain-tensor functions (see the module docstring)."""

    layer = staticmethod(whisper_layer)
    encoder_decoder = True

    def __init__(self, model):
        reason = whisper_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"no native path for this model: {reason}")
        dec = model.model.decoder
        cfg = model.config
        self.model = model
        self.heads = cfg.decoder_attention_heads
        self.head_dim = cfg.d_model // self.heads
        self.eps = float(dec.layer_norm.eps)
        self.embed = dec.embed_tokens.weight
        self.positions = dec.embed_positions.weight
        self.norm_w, self.norm_b = dec.layer_norm.weight, dec.layer_norm.bias
        self.lm_head = model.get_output_embeddings().weight
        self.layers = [_layer_weights(layer) for layer in dec.layers]
        self._cross = [(layer.encoder_attn.k_proj, layer.encoder_attn.v_proj) for layer in dec.layers]
        self.dtype = self.embed.dtype

    def new_caches(self, batch: int, capacity: int) -> list:
        shape = (batch, self.heads, capacity, self.head_dim)
        dev = self.embed.device
        return [(torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
                for _ in self.layers]

    def cross_states(self, encoder_out: torch.Tensor) -> list:
        """encoder_out [B, T, d] -> per layer (K_x, V_x) [B, H, T, D]."""
        b, t, _ = encoder_out.shape
        out = []
        for k_proj, v_proj in self._cross:
            k = k_proj(encoder_out).view(b, t, self.heads, self.head_dim).transpose(1, 2).contiguous()
            v = v_proj(encoder_out).view(b, t, self.heads, self.head_dim).transpose(1, 2).contiguous()
            out.append((k, v))
        return out

    def forward(self, tokens, positions, mask, write_pos, caches, keep=None, layer_fn=whisper_layer, **layer_kw):
        """bool mask [B, 1, q, C]; caches: per layer (K, V, K_x, V_x) -> logits [B, q or keep, V] (model dtype)."""
        mask = additive_mask(mask, self.embed.dtype)
        h = F.embedding(tokens, self.embed) + F.embedding(positions, self.positions)
        for w, (k, v, ck, cv) in zip(self.layers, caches):
            h = layer_fn(h, mask, write_pos, k, v, ck, cv, w.ln1_w, w.ln1_b, w.qkv_w, w.qkv_b, w.o_w, w.o_b,
                         w.ln2_w, w.ln2_b, w.cq_w, w.cq_b, w.co_w, w.co_b, w.ln3_w, w.ln3_b, w.fc1_w, w.fc1_b,
                         w.fc2_w, w.fc2_b, heads=self.heads, head_dim=self.head_dim, eps=self.eps, **layer_kw)
        if keep is not None:
            h = h[:, -keep:]
        h = F.layer_norm(h, (h.shape[-1],), self.norm_w, self.norm_b, self.eps)
        return F.linear(h, self.lm_head)
