"""The target's forward over paged K/V: every scheduled request's new tokens flattened into one [T] batch.

Weights and maths are the native Llama-family decoder's (engine/native/llama.py: fused q/k/v and gate/up, fp32
RMSNorm, transformers' RoPE); only the cache differs: per layer K and V of shape [num_blocks * block_size, H_kv, D]
(slot-major: slot = block * block_size + offset), the step's K/V written at ``slots`` (padding tokens write to the
scratch block 0) with ``index_copy_`` on the cache tensor itself -- not on a view of it, which a compiled graph may
turn into a copy of the whole cache per step -- and
attention through the requests' block tables (engine/paged/attention.py). Prefill chunks of several prompts and the
decode rows of every running request go through the same forward, so the weights are read once per step.

On CUDA with ``compile=True`` the layer, prologue and head are ``torch.compile``d with symbolic sizes (one compile
serves every T), and decode steps of a fixed (rows, width) shape are captured as CUDA graphs (:meth:`decode`);
one-token steps (a single request decoding) run the fused layer instead (:func:`paged_fused_layer`) while the
runtime's kernel set holds ``layer`` (``PagedModel.fused``).

With a trained draft head attached (:meth:`PagedModel.capture_features`, engine/paged/head.py) every fed token's
head input -- ``fc`` of its hidden states at the head's ``feature_layers``, transformers' ``hidden_states``
numbering (i = output of layer i - 1: ``h + res`` of the pair; i = L: after the final norm, as transformers
returns it) -- is written at the token's slot of a feature cache [num_blocks * block_size, d] (padding tokens: the
scratch block), in the same forward and under the same slots as the K/V; without a head nothing is captured.

``deterministic=True`` (the engine's batch-invariant mode): every linear and RMSNorm of the layer and head is
invariant.py's (one launch configuration whatever the token count), the attention runs with ``invariant=True`` (one
KV split, a fixed tile: attention.launch_plan) and the fused one-token layer is never used, so a token row's logits
are bitwise the same whatever else the step holds. The rest is element-wise or a gather (the same per element
whatever T); the prologue does not normalise. Eager and compiled element-wise code may round differently, so the
invariance holds within one engine (an engine whose compile fails and falls back to eager starts another run).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..graphs import GraphCache, workspace_epoch
from ..native import fused_layer
from ..native.linear import fused_linear
from ..native.llama import NativeLlama, _rotate_half, rms_norm
from ..native.qkv_rope import qkv_rope
from ..native.runner import active_kernel_parts, native_model
from . import invariant as inv
from .attention import paged_attention
from .blocks import kv_zeros
from .piecewise import MIXED_BUCKETS, Pieces


@dataclass
class StepInputs:
    """One step's device inputs. tokens / positions / slots [T] int64; tables [S, M] int32 (block ids per request);
    cu_q [S + 1] int32 (request s owns rows cu_q[s]:cu_q[s+1]); kv_lens [S] int32 (its length after the step);
    rows [N] int64 (the token rows whose logits are wanted); max_q: a host bound on any request's token count;
    tree_mask [T] int64 or None: the tokens' ancestor bitmasks when a request's new tokens are a draft tree
    (attention.py; engine/paged/tree.py), outside ``tensors()``: tree steps run eagerly, never from a graph."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    cu_q: torch.Tensor
    kv_lens: torch.Tensor
    rows: torch.Tensor
    max_q: int
    tree_mask: Optional[torch.Tensor] = None

    def tensors(self) -> tuple:
        return (self.tokens, self.positions, self.slots, self.tables, self.cu_q, self.kv_lens, self.rows)


def _ops(invariant: bool) -> tuple:
    """(linear, rms_norm): the batch-invariant ones (invariant.py) for the deterministic mode, else the library's."""
    return (inv.linear, inv.rms_norm) if invariant else (F.linear, rms_norm)


def paged_pre(h, res, cos, sin, slots, k_cache, v_cache, ln1, qkv, qkv_bias, *, heads: int, kv_heads: int,
              head_dim: int, eps: float, invariant: bool = False):
    """A layer's part before attention: residual add, norm, q/k/v, RoPE, the tokens' K/V written at ``slots`` ->
    (queries [T, H, D], residual). ``invariant``: the deterministic mode's operators (here and below)."""
    linear, norm = _ops(invariant)
    t = h.shape[0]
    res = h + res
    proj = linear(norm(res, ln1, eps), qkv, qkv_bias)
    nq, nkv = heads * head_dim, kv_heads * head_dim
    xq = proj[:, :nq].view(t, heads, head_dim)
    xk = proj[:, nq:nq + nkv].view(t, kv_heads, head_dim)
    xv = proj[:, nq + nkv:].view(t, kv_heads, head_dim)
    cos, sin = cos[:, None], sin[:, None]
    xq = (xq * cos + _rotate_half(xq) * sin).to(h.dtype)
    xk = (xk * cos + _rotate_half(xk) * sin).to(h.dtype)
    k_cache.index_copy_(0, slots, xk)
    v_cache.index_copy_(0, slots, xv)
    return xq, res


def paged_post(attn, res, o, ln2, gate_up, down, *, eps: float, invariant: bool = False):
    """A layer's part after attention: o projection + residual, norm, gate/up, SiLU, down -> (h, residual)."""
    linear, norm = _ops(invariant)
    res = res + linear(attn.reshape(attn.shape[0], -1), o)
    gu = linear(norm(res, ln2, eps), gate_up)
    f = gu.shape[-1] // 2
    return linear(F.silu(gu[:, :f]) * gu[:, f:], down), res


def paged_layer(h, res, cos, sin, slots, tables, cu_q, kv_lens, k_cache, v_cache, ln1, qkv, qkv_bias, o, ln2,
                gate_up, down, *, heads: int, kv_heads: int, head_dim: int, eps: float, max_q: int, block_size: int,
                invariant: bool = False, tree_mask=None):
    """One pre-norm decoder layer over T flattened tokens (h, res [T, d]); writes their K/V at ``slots`` of the
    slot-major caches [num_blocks * block_size, H_kv, D] and attends through the block tables. Same maths as
    native.llama.decoder_layer (the residual carried as a pair); ``tree_mask``: draft-tree rows (StepInputs)."""
    xq, res = paged_pre(h, res, cos, sin, slots, k_cache, v_cache, ln1, qkv, qkv_bias, heads=heads,
                        kv_heads=kv_heads, head_dim=head_dim, eps=eps, invariant=invariant)
    attn = paged_attention(xq, k_cache.unflatten(0, (-1, block_size)), v_cache.unflatten(0, (-1, block_size)),
                           tables, cu_q, kv_lens, max_q=max_q, invariant=invariant, tree_mask=tree_mask)
    return paged_post(attn, res, o, ln2, gate_up, down, eps=eps, invariant=invariant)


def paged_fused_layer(h, res, cos, sin, slots, tables, cu_q, kv_lens, k_cache, v_cache, ln1, qkv, qkv_bias, o, ln2,
                      gate_up, down, *, heads: int, kv_heads: int, head_dim: int, eps: float, max_q: int,
                      block_size: int):
    """:func:`paged_layer` for a one-token step (T = 1: a single request's decode) as tilespec's kernels
    (native/fused_layer.py: q/k/v with the residual add, norm, RoPE and the paged cache write in one launch, the
    paged attention, o + residual, norm + gate/up + SiLU, down). Same contract and maths."""
    t = h.shape[0]
    res, xq = qkv_rope(h[None], res[None], ln1, qkv, qkv_bias, cos[None], sin[None], k_cache, v_cache, slots,
                       heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps, slots=True)
    attn = paged_attention(xq.view(t, heads, head_dim), k_cache.unflatten(0, (-1, block_size)),
                           v_cache.unflatten(0, (-1, block_size)), tables, cu_q, kv_lens, max_q=max_q)
    res = fused_linear(attn.reshape(t, heads * head_dim), o, residual=res[0])
    return fused_linear(fused_linear(res, gate_up, norm=ln2, eps=eps, silu_mul=True), down), res


def paged_prologue(tokens, positions, embed, inv_freq, rope_scale: float):
    """tokens / positions [T] -> (h, zeros) [T, d], cos / sin [T, D] fp32."""
    h = F.embedding(tokens, embed)
    freqs = positions.float()[:, None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return h, torch.zeros_like(h), emb.cos() * rope_scale, emb.sin() * rope_scale


def paged_head(h, res, rows, norm, lm_head, eps: float, invariant: bool = False):
    """(h, res) [T, d] -> logits [N, V] at token ``rows`` (model dtype)."""
    linear, rms = _ops(invariant)
    x = (h + res).index_select(0, rows)
    return linear(rms(x, norm, eps), lm_head)


class PagedModel:
    """A Llama-family target over ``num_blocks`` paged blocks (see the module docstring)."""

    def __init__(self, model, num_blocks: int, block_size: int, *, compile: bool = False, deterministic: bool = False):
        native = native_model(model)
        if not isinstance(native, NativeLlama):
            raise ValueError("the paged engine runs Llama-family decoders (Llama, Qwen2, Mistral, SmolLM2)")
        self.native, self.block_size, self.num_blocks = native, block_size, num_blocks
        self.deterministic = bool(deterministic)    # batch-invariant operators (invariant.py), no fused layer
        self.device = native.embed.device
        shape = (num_blocks * block_size, native.kv_heads, native.head_dim)
        kv = kv_zeros(shape, native.dtype, self.device, 2 * len(native.layers))
        self.caches = list(zip(kv[0::2], kv[1::2]))
        self.graphs = compile and self.device.type == "cuda"
        self._fns = (paged_prologue, paged_layer, paged_head)
        if self.graphs:
            # dynamo's recompile limit counts per code object, across every model of the process: a target, its
            # draft model and a head's feature widths each specialise these functions (a GPU test with two models
            # in one process hit the default 8)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._fns = tuple(torch.compile(fn, dynamic=True, fullgraph=True) for fn in self._fns)
        self._decode = GraphCache(self._graph_forward, max_graphs=1024) if self.graphs else None
        # mixed steps: piecewise graphs per token bucket (piecewise.py), attention eager between the pieces
        self.piecewise, self._pieces, self._pool, self._epoch = self.graphs, {}, None, workspace_epoch()
        self._piece_fns = (paged_prologue, paged_pre, paged_post, paged_head)
        if self.graphs:
            self._piece_fns = tuple(torch.compile(fn, dynamic=True, fullgraph=True) for fn in self._piece_fns)
        # one-token decode steps on the fused layer (the runtime's kernel part "layer"; compiled engines only, and
        # only in decode(): its launches cost nothing inside a captured graph, mixed steps keep the compiled layer)
        self.fused = self.graphs and "layer" in active_kernel_parts() and not self.deterministic

    captures_piecewise = 0
    feature_layers: tuple = ()      # the hidden-state indices a draft head reads (capture_features); () captures none

    def capture_features(self, layers: tuple, fuse, cache: torch.Tensor) -> None:
        """From now on write ``fuse(cat(hidden states at layers))`` of every fed token at its slot of ``cache``
        [num_blocks * block_size, d] (a draft head's input, head.py; before any graph is captured)."""
        self.feature_layers, self._fuse, self.feature_cache = tuple(layers), fuse, cache

    def keep_feature(self, feats: dict, index: int, h: torch.Tensor, res: torch.Tensor) -> None:
        """Hold hidden state ``index`` (the output of layer index - 1, as the pair h, res) when the head reads it."""
        if index in self.feature_layers:
            x = h + res
            n = self.native
            feats[index] = rms_norm(x, n.norm, n.eps) if index == n.num_layers else x

    def write_features(self, feats: dict, slots: torch.Tensor) -> None:
        if feats:
            fused = self._fuse(torch.cat([feats[i] for i in self.feature_layers], dim=-1))
            self.feature_cache.index_copy_(0, slots, fused.to(self.feature_cache.dtype))

    @property
    def captures(self) -> int:
        """Step shapes captured so far: decode graphs and mixed buckets (0 without graphs)."""
        return (self._decode.captures if self._decode is not None else 0) + self.captures_piecewise

    @staticmethod
    def kv_bytes_per_token(model) -> int:
        native = native_model(model)
        return 2 * native.num_layers * native.kv_heads * native.head_dim * native.embed.element_size()

    def memory_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.caches)

    def _run(self, fns, tokens, positions, slots, tables, cu_q, kv_lens, rows, max_q: int, fused: bool = False,
             tree_mask=None):
        prologue, layer, head = fns
        n = self.native
        h, res, cos, sin = prologue(tokens, positions, n.embed, n.inv_freq, n.rope_scale)
        if (fused and not self.deterministic and tokens.shape[0] == 1 and tree_mask is None
                and fused_layer.usable(n, h, *self.caches[0])):
            layer = paged_fused_layer
        feats, mode = {}, {"invariant": True} if self.deterministic else {}
        head_mode = dict(mode)
        if tree_mask is not None:       # passed only when given: chain steps call the layers as before
            mode["tree_mask"] = tree_mask
        for i, (w, (k_cache, v_cache)) in enumerate(zip(n.layers, self.caches)):
            h, res = layer(h, res, cos, sin, slots, tables, cu_q, kv_lens, k_cache, v_cache, w.ln1, w.qkv,
                           w.qkv_bias, w.o, w.ln2, w.gate_up, w.down, heads=n.heads, kv_heads=n.kv_heads,
                           head_dim=n.head_dim, eps=n.eps, max_q=max_q, block_size=self.block_size, **mode)
            self.keep_feature(feats, i + 1, h, res)
        self.write_features(feats, slots)
        return head(h, res, rows, n.norm, n.lm_head, n.eps, **head_mode)

    def _graph_forward(self, *tensors, key=None):
        return self._run(self._fns, *tensors, max_q=key, fused=self.fused)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, fused: bool = False) -> torch.Tensor:
        """Any step (prefill chunks, decode rows, both) -> fp32 logits [N, V] at ``inputs.rows``; ``fused``: a
        one-token step runs :func:`paged_fused_layer`."""
        tree = {} if inputs.tree_mask is None else {"tree_mask": inputs.tree_mask}
        try:
            return self._run(self._fns, *inputs.tensors(), max_q=inputs.max_q, fused=fused, **tree).float()
        except Exception as err:        # stay correct where a compile fails: eager from now on
            if self._fns[1] is paged_layer:
                raise
            warnings.warn(f"compiled paged forward failed ({type(err).__name__}: {err}); running eagerly")
            self._fns, self.graphs, self._decode = (paged_prologue, paged_layer, paged_head), False, None
            return self._run(self._fns, *inputs.tensors(), max_q=inputs.max_q, fused=fused, **tree).float()

    def graph_pool(self):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    @torch.inference_mode()
    def mixed(self, inputs: StepInputs) -> torch.Tensor:
        """A mixed step -> fp32 logits at ``inputs.rows``: piecewise (graphs on CUDA) when ``piecewise`` is on and
        the tokens fill a mixed bucket the caller padded to (piecewise.MIXED_BUCKETS), else :meth:`forward`."""
        size = inputs.tokens.shape[0]
        if not self.piecewise or size not in MIXED_BUCKETS or inputs.tree_mask is not None:
            return self.forward(inputs)
        if self._epoch != workspace_epoch():        # a cuBLAS workspace the graphs use was freed: capture again
            self._pieces, self._pool, self._epoch = {}, None, workspace_epoch()
        pieces = self._pieces.get(size)
        if pieces is None:
            try:
                pieces = self._pieces[size] = Pieces(self, size, self._piece_fns, capture=self.graphs)
                self.captures_piecewise += 1
            except Exception as err:        # stay correct where a capture fails: unpadded eager steps from now on
                warnings.warn(f"piecewise capture of mixed steps failed ({type(err).__name__}: {err}); "
                              "running them eagerly")
                self.piecewise, self._pieces = False, {}
                return self.forward(inputs)
        return pieces(inputs).float()

    @torch.inference_mode()
    def decode(self, inputs: StepInputs) -> torch.Tensor:
        """A decode step of fixed shape (every request the same width): a CUDA-graph replay where graphs are on
        (captured on the first call of each shape), else :meth:`forward`. Returns fp32 logits [N, V] (fresh)."""
        if self._decode is None or inputs.tree_mask is not None:     # tree steps: no graph captures them yet
            return self.forward(inputs, fused=self.fused)
        return self._decode(*inputs.tensors(), key=inputs.max_q).float()
