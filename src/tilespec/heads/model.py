"""An EAGLE-3-style draft head: one decoder layer of the target's architecture over [fused target features, token].

Inputs of one head *entry* at position e (the same slot layout as the target's cache):
  * a feature vector f_e [d]: for an entry whose target features are known, ``fc`` of the concatenated hidden states
    of three target layers (low / mid / high, ``feature_layers``: indices into transformers' ``hidden_states``,
    0 = embeddings, i = output of layer i - 1) at position e; for a drafted entry, the head's own output at e - 1;
  * the embedding (the target's, frozen) of the token at position e + 1.
The layer: x = [RMSNorm(emb), RMSNorm(f_e)] (2d) -> attention (q/k/v from 2d, RoPE at position e, GQA as the
target) -> residual f_e + o(attn) -> gated MLP -> h_e [d]. ``logits(h_e)`` = RMSNorm(h_e) @ lm_head[vocab].T: the
head's distribution of the token at position e + 2, over the draft vocabulary ``vocab`` [N] (target ids; all V
when no reduced vocabulary): q is zero outside it. The LM head rows are the target's, frozen.

Shapes: features [B, q, 3d] (or [B, q, d] for own outputs), tokens/positions [B, q] int64; caches [B, H_kv, C, D].
The plain-tensor functions (:func:`head_entries`) are what the engine runs (and torch.compile / CUDA graphs capture);
the module's ``parameters()`` are only the trainable weights (the target's embedding and LM head are not parameters).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HeadConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    feature_layers: tuple
    vocab_size: int            # the target's V
    draft_vocab: int           # N (== vocab_size: no reduced vocabulary)
    rope_theta: float = 10000.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        d = dict(d)
        d["feature_layers"] = tuple(d["feature_layers"])
        return cls(**d)


def default_feature_layers(num_layers: int) -> tuple:
    """Low / mid / high hidden-state indices (outputs of layers 1, L/2 - 1 and L - 3; distinct, in [1, L - 1])."""
    if num_layers < 2:
        return (1,)
    picks = sorted({min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 2)})
    return tuple(picks)


def config_for(target, *, draft_vocab: Optional[int] = None, feature_layers: Optional[tuple] = None,
               intermediate: Optional[int] = None) -> HeadConfig:
    """The head config for a transformers Llama-family target (one layer of the target's shape)."""
    cfg = target.config
    heads = cfg.num_attention_heads
    vocab = target.get_output_embeddings().weight.shape[0]
    layers = tuple(feature_layers or default_feature_layers(cfg.num_hidden_layers))
    if any(not 1 <= i < cfg.num_hidden_layers for i in layers) and cfg.num_hidden_layers > 1:
        raise ValueError(f"feature layers must lie in [1, {cfg.num_hidden_layers - 1}], got {layers}")
    n = vocab if draft_vocab is None else int(draft_vocab)
    if not 1 <= n <= vocab:
        raise ValueError(f"draft_vocab must be in [1, {vocab}], got {draft_vocab}")
    return HeadConfig(hidden=cfg.hidden_size, heads=heads, kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
                      head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                      intermediate=int(intermediate or cfg.intermediate_size), eps=float(cfg.rms_norm_eps),
                      feature_layers=layers, vocab_size=vocab, draft_vocab=n,
                      rope_theta=float(getattr(cfg, "rope_theta", None) or
                                       (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DraftHead(nn.Module):
    """The trainable head (see the module docstring); ``bind(target)`` attaches the target's frozen embedding, LM
    head rows and RoPE frequencies (not parameters, never saved)."""

    def __init__(self, cfg: HeadConfig, vocab_ids: Optional[torch.Tensor] = None):
        super().__init__()
        self.cfg = cfg
        d, h, kv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.fc = nn.Linear(len(cfg.feature_layers) * d, d, bias=False)
        self.ln_emb = nn.Parameter(torch.ones(d))
        self.ln_feat = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(2 * d, (h + 2 * kv) * hd, bias=True)
        self.o = nn.Linear(h * hd, d, bias=False)
        self.ln_mlp = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, d, bias=False)
        self.ln_out = nn.Parameter(torch.ones(d))
        ids = torch.arange(cfg.vocab_size) if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.int64)
        if ids.ndim != 1 or ids.numel() != cfg.draft_vocab:
            raise ValueError(f"vocab_ids must hold draft_vocab={cfg.draft_vocab} target ids, got {tuple(ids.shape)}")
        self.register_buffer("vocab_ids", ids.clone())
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv, persistent=False)
        self.embed: Optional[torch.Tensor] = None      # [V, d] the target's, frozen
        self.lm_rows: Optional[torch.Tensor] = None    # [N, d] the target's LM head rows of vocab_ids, frozen
        self.rope_scale = 1.0

    def bind(self, target) -> "DraftHead":
        """Attach the target's embedding / LM head (rows of the draft vocabulary) and RoPE table; also copies the
        target's final norm into ``ln_out`` when the head is fresh (``init``)."""
        inner = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        self.embed = inner.embed_tokens.weight.detach()
        lm = target.get_output_embeddings().weight.detach()
        ids = self.vocab_ids.to(lm.device)
        self.lm_rows = lm if ids.numel() == lm.shape[0] and bool((ids == torch.arange(
            lm.shape[0], device=lm.device)).all()) else lm.index_select(0, ids)
        rotary = getattr(inner, "rotary_emb", None)
        if rotary is not None:
            self.inv_freq = rotary.inv_freq.detach().float().to(self.inv_freq.device)
            self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        return self

    def init_from(self, target) -> "DraftHead":
        """A fresh head's starting point: the output norm is the target's final norm; the layer's norms, attention
        and MLP start from the target's last layer where shapes allow (q/k/v: the feature half)."""
        inner = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        with torch.no_grad():
            self.ln_out.copy_(inner.norm.weight.float())
            last = inner.layers[-1]
            at, mlp = last.self_attn, last.mlp
            q = torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]).float()
            if q.shape[1] == self.cfg.hidden:
                self.qkv.weight[:, self.cfg.hidden:].copy_(q)
                self.qkv.weight[:, :self.cfg.hidden].copy_(q)
                self.qkv.weight.mul_(0.5)
            if at.q_proj.bias is not None:
                self.qkv.bias.copy_(torch.cat([at.q_proj.bias, at.k_proj.bias, at.v_proj.bias]).float())
            else:
                self.qkv.bias.zero_()
            self.o.weight.copy_(at.o_proj.weight.float())
            if mlp.gate_proj.weight.shape[0] == self.cfg.intermediate:
                self.gate_up.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float())
                self.down.weight.copy_(mlp.down_proj.weight.float())
            self.ln_mlp.copy_(last.post_attention_layernorm.weight.float())
            self.ln_feat.copy_(last.input_layernorm.weight.float())
            self.ln_emb.copy_(last.input_layernorm.weight.float())
        return self

    # ------------------------------------------------------------------------------------------ pieces
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, q] -> cos, sin [B, 1, q, D] fp32."""
        freqs = positions.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.rope_scale)[:, None], (emb.sin() * self.rope_scale)[:, None]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target hidden states [.., 3d] -> the feature stream [.., d]."""
        return self.fc(features.to(self.fc.weight.dtype))

    def qkv_of(self, feat: torch.Tensor, tokens: torch.Tensor, cos, sin) -> tuple:
        """feat [B, q, d], tokens [B, q] -> q [B, H, q, D], k / v [B, H_kv, q, D] (RoPE applied)."""
        c = self.cfg
        b, q, _ = feat.shape
        emb = F.embedding(tokens.clamp(min=0), self.embed).to(feat.dtype)
        x = torch.cat([rms(emb, self.ln_emb, c.eps), rms(feat, self.ln_feat, c.eps)], dim=-1)
        proj = self.qkv(x)
        nq, nkv = c.heads * c.head_dim, c.kv_heads * c.head_dim
        xq = proj[..., :nq].view(b, q, c.heads, c.head_dim).transpose(1, 2)
        xk = proj[..., nq:nq + nkv].view(b, q, c.kv_heads, c.head_dim).transpose(1, 2)
        xv = proj[..., nq + nkv:].view(b, q, c.kv_heads, c.head_dim).transpose(1, 2)
        return rotate(xq, cos, sin).to(feat.dtype), rotate(xk, cos, sin).to(feat.dtype), xv

    def finish(self, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """feat [B, q, d], attn [B, H, q, D] -> the head's output h [B, q, d]."""
        b, _, q, _ = attn.shape
        res = feat + self.o(attn.transpose(1, 2).reshape(b, q, -1))
        gu = self.gate_up(rms(res, self.ln_mlp, self.cfg.eps))
        f = gu.shape[-1] // 2
        return res + self.down(F.silu(gu[..., :f]) * gu[..., f:])

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        return rms(h, self.ln_out, self.cfg.eps)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [.., d] -> logits over the draft vocabulary [.., N] (h's dtype)."""
        return F.linear(self.normed(h), self.lm_rows.to(h.dtype))

    def full_logits(self, small: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [.., N] -> fp32 [.., V], -inf outside the draft vocabulary (q = 0 there)."""
        if self.cfg.draft_vocab == self.cfg.vocab_size:
            return small.float()
        out = torch.full((*small.shape[:-1], self.cfg.vocab_size), float("-inf"), dtype=torch.float32,
                         device=small.device)
        return out.scatter_(-1, self.vocab_ids.expand(*small.shape[:-1], -1), small.float())

    # ------------------------------------------------------------------------------------------ inference
    def entries(self, feat: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                write_pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q head entries at slots write_pos + [0, q) of the head's cache: feat [B, q, d] (fused or own outputs),
        tokens (the next token of each entry) / positions [B, q], bool mask [B, 1, q, C] (True = attend) ->
        h [B, q, d]. Writes K/V like a target layer (engine/native/llama.py)."""
        cos, sin = self.rope(positions)
        xq, xk, xv = self.qkv_of(feat, tokens, cos, sin)
        slots = write_pos + torch.arange(tokens.shape[1], device=tokens.device)
        k_cache.index_copy_(2, slots, xk)
        v_cache.index_copy_(2, slots, xv)
        additive = torch.zeros(mask.shape, dtype=xq.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(xq.dtype).min)
        attn = F.scaled_dot_product_attention(xq, k_cache, v_cache, attn_mask=additive,
                                              enable_gqa=self.cfg.heads != self.cfg.kv_heads)
        return self.finish(feat, attn)

    def new_cache(self, batch: int, capacity: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (batch, self.cfg.kv_heads, capacity, self.cfg.head_dim)
        return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)

    # ------------------------------------------------------------------------------------------ training
    def ttt_forward(self, fused: torch.Tensor, tokens_next: torch.Tensor, steps: int) -> list:
        """Training-time test over whole sequences: fused [B, T, d] (``fuse`` of the target features at every
        position), tokens_next [B, T] (token e + 1 for entry e) -> [h_1, .., h_steps], each [B, T, d].

        Step 1 is the head on the target's features; step k's entry at e uses step k-1's output at e - 1 as its
        feature (as when drafting k tokens ahead) and attends to step-1 keys at positions <= e - k + 1 and to step m's
        key at e - (k - m) for 2 <= m <= k: exactly the cache a drafted entry sees at inference."""
        b, t, _ = fused.shape
        pos = torch.arange(t, device=fused.device)[None].expand(b, t)
        cos, sin = self.rope(pos)
        group = self.cfg.heads // self.cfg.kv_heads
        scale = self.cfg.head_dim ** -0.5
        outs, keys, values = [], [], []
        feat = fused
        for k in range(1, steps + 1):
            if k > 1:
                feat = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
            xq, xk, xv = self.qkv_of(feat, tokens_next, cos, sin)
            keys.append(xk.repeat_interleave(group, dim=1))
            values.append(xv.repeat_interleave(group, dim=1))
            scores = torch.matmul(xq, keys[0].transpose(-1, -2)).float() * scale     # [B, H, T, T]
            causal = torch.ones(t, t, dtype=torch.bool, device=fused.device).tril(-(k - 1))
            scores = scores.masked_fill(~causal, float("-inf"))
            diag = []
            for m in range(2, k + 1):
                shift = k - m
                km = torch.roll(keys[m - 1], shifts=shift, dims=2)
                s = (xq.float() * km.float()).sum(-1, keepdim=True) * scale          # [B, H, T, 1]
                if shift:
                    s[:, :, :shift] = float("-inf")
                diag.append(s)
            allsc = torch.cat([scores] + diag, dim=-1)
            # rows with nothing to attend to (e < k - 1) get a uniform row over finite zeros: their loss is masked
            allsc = torch.where(torch.isneginf(allsc).all(-1, keepdim=True), torch.zeros_like(allsc), allsc)
            p = torch.softmax(allsc, dim=-1)
            attn = torch.matmul(p[..., :t].to(values[0].dtype), values[0])
            for j, m in enumerate(range(2, k + 1)):
                vm = torch.roll(values[m - 1], shifts=k - m, dims=2)
                attn = attn + p[..., t + j:t + j + 1].to(vm.dtype) * vm
            outs.append(self.finish(feat, attn.to(feat.dtype)))
        return outs
