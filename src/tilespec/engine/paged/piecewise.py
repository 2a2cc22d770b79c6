"""Mixed steps (prefill chunks beside decode rows) replayed piece by piece, as vLLM's piecewise CUDA graphs do.

A mixed step's shape changes every step (sequences, chunk lengths, tables), so it cannot be one graph; run eagerly
it costs 25-47 ms of host time on a 28-layer 1.5B model (a compiled call, a custom operator and its launches per
layer) against ~3 ms on the device. Everything but attention depends on the token count alone, so with the tokens
padded to a *mixed bucket* T_b (padding tokens lie outside every sequence: they write K/V to the scratch block and
attend to nothing) the model splits into fixed-shape pieces per bucket: the prologue (embedding, RoPE tables), and
per layer the part before attention (norm, q/k/v, RoPE, K/V write) and the part after it (o projection, MLP). Each
piece is one captured graph; attention between them runs eagerly on the step's own metadata into a static buffer,
and the head runs eagerly on the step's logit rows. A step then costs 2 x layers graph launches + layers kernel
launches of host time.

On CPU (no graphs) :class:`Pieces` runs the same pieces and buffers directly, so the layout and the static-buffer
flow are tested there (tests/test_paged_pricing.py); capture itself is tested on CUDA (tests/test_paged_engine_gpu.py).
"""
from __future__ import annotations

import torch

from .attention import paged_attention

MIXED_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def mixed_buckets(token_budget: int) -> tuple:
    """The mixed buckets a step of at most ``token_budget`` tokens may need."""
    top = next((b for b in MIXED_BUCKETS if b >= token_budget), MIXED_BUCKETS[-1])
    return tuple(b for b in MIXED_BUCKETS if b <= top)


def mixed_bucket(tokens: int, buckets: tuple):
    """The smallest bucket holding ``tokens``; None above them all (the step runs unpadded, eagerly)."""
    return next((b for b in buckets if b >= tokens), None)


class Pieces:
    """The pieces of one mixed bucket ``size`` for ``model`` (a PagedModel): static inputs, the prologue / pre / post
    pieces (captured as graphs when ``capture``), attention between them. ``fns``: (prologue, pre, post, head)."""

    def __init__(self, model, size: int, fns: tuple, capture: bool):
        self.model, self.size = model, size
        self.prologue, self.pre, self.post, self.head = fns
        n, dev = model.native, model.device
        self.tokens = torch.zeros(size, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(size, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(size, dtype=torch.int64, device=dev)
        self.attn = torch.zeros((size, n.heads, n.head_dim), dtype=n.dtype, device=dev)
        self.graphs = None
        if capture:
            self._capture()

    # the pieces, each a function of static tensors only
    def _run_prologue(self):
        n = self.model.native
        self.h, self.res, self.cos, self.sin = self.prologue(self.tokens, self.positions, n.embed, n.inv_freq,
                                                             n.rope_scale)

    def _run_pre(self, i: int):
        n, w = self.model.native, self.model.native.layers[i]
        k_cache, v_cache = self.model.caches[i]
        self.xq[i], self.mid[i] = self.pre(self.hs[i], self.ress[i], self.cos, self.sin, self.slots, k_cache,
                                           v_cache, w.ln1, w.qkv, w.qkv_bias, heads=n.heads, kv_heads=n.kv_heads,
                                           head_dim=n.head_dim, eps=n.eps, invariant=self.model.deterministic)

    def _run_post(self, i: int):
        n, w = self.model.native, self.model.native.layers[i]
        self.hs[i + 1], self.ress[i + 1] = self.post(self.attn, self.mid[i], w.o, w.ln2, w.gate_up, w.down,
                                                     eps=n.eps, invariant=self.model.deterministic)

    def _pieces(self) -> list:
        layers = len(self.model.native.layers)
        self.xq, self.mid = [None] * layers, [None] * layers
        self.hs, self.ress = [None] * (layers + 1), [None] * (layers + 1)

        def prologue():
            self._run_prologue()
            self.hs[0], self.ress[0] = self.h, self.res
        out = [prologue]
        for i in range(layers):
            out += [lambda i=i: self._run_pre(i), lambda i=i: self._run_post(i)]
        return out

    def _capture(self) -> None:
        """Each piece run once on a side stream (compiles, lazy initialisation), then captured in turn; the
        outputs of one are the inputs of the next, so they stay alive in the model's graph pool."""
        from ..graphs import _capture_stream, quiet_capture
        pieces = self._pieces()
        side = _capture_stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for piece in pieces:
                piece()
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        pool = self.model.graph_pool()
        graphs = []
        for piece in pieces:
            g = torch.cuda.CUDAGraph()
            with quiet_capture(), torch.cuda.graph(g, pool=pool, stream=side):
                piece()
            graphs.append(g)
        self.graphs = graphs

    def __call__(self, inputs) -> torch.Tensor:
        """One mixed step (StepInputs of exactly ``size`` tokens) -> the head's logits at ``inputs.rows``."""
        self.tokens.copy_(inputs.tokens)
        self.positions.copy_(inputs.positions)
        self.slots.copy_(inputs.slots)
        m, n = self.model, self.model.native
        pieces = self.graphs or self._pieces()
        run = (lambda k: pieces[k].replay()) if self.graphs else (lambda k: pieces[k]())
        run(0)
        for i in range(len(n.layers)):
            run(1 + 2 * i)
            k_cache, v_cache = m.caches[i]
            paged_attention(self.xq[i], k_cache.unflatten(0, (-1, m.block_size)),
                            v_cache.unflatten(0, (-1, m.block_size)), inputs.tables, inputs.cu_q, inputs.kv_lens,
                            max_q=inputs.max_q, out=self.attn, invariant=m.deterministic)
            run(2 + 2 * i)
        if m.feature_layers:        # a draft head's input (model.py), from the pieces' static outputs
            feats = {}
            for j in m.feature_layers:
                m.keep_feature(feats, j, self.hs[j], self.ress[j])
            m.write_features(feats, self.slots)
        return self.head(self.hs[-1], self.ress[-1], inputs.rows, n.norm, n.lm_head, n.eps, m.deterministic)
