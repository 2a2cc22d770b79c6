"""``head``: drafts from a trained EAGLE-style head (tilespec.heads) that reads the target's own hidden states.

Per generation the drafter builds a :class:`HeadRunner` (its :class:`~.base.DraftRunner`): the head's one-layer
K/V cache (same slot layout and ``valid`` mask as the target's) plus two functions of device tensors, run by the
engine's step body (eagerly, or captured in the whole-step CUDA graphs, step_graph.py):
  * :meth:`HeadRunner.propose` -- γ draft tokens autoregressively from ``view.hidden`` [B, d] (the head's output at
    the last committed entry), with their draft logits over the full vocabulary when sampling (-inf outside a
    reduced draft vocabulary: q is zero there, which verify() handles exactly); γ - 1 head forwards;
  * :meth:`HeadRunner.observe` -- after verification, the head's entries for the verified chunk from the features the
    target's verify forward returned (no extra target forward): slots [W, W + K], fed (target features at each
    position, the token emitted after it); returns the new ``hidden`` (the entry of the last accepted position).
Draft entries written by ``propose`` at slots >= W are overwritten by ``observe``'s real entries, so the cache
holds only entries built from the target's features at committed positions (holes as in the target's cache).

``head+ngram``: context drafts (``ngram``) where the context matches, the head elsewhere; the head observes every
verify forward either way, so it stays current.
"""
from __future__ import annotations

import warnings
import weakref
from pathlib import Path
from typing import Optional, Sequence

import torch

from tilespec.verify import rng
from tilespec.verify.sampling import sample_keyed

from ..cache import gather_attr
from ..state import chunk_mask
from .base import ContextDrafter, ContextState, Drafter, DraftRunner, Proposal, StepView


def target_name(model) -> str:
    """The registry name the models layer gave ``model`` (``tilespec_name``), else its config's name/path."""
    name = getattr(model, "tilespec_name", None) or getattr(model.config, "_name_or_path", "") or ""
    return str(name) or type(model).__name__


def _sample_draft_vocab(small: torch.Tensor, vocab_ids: torch.Tensor, resolved, seeds: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """One token per row from the processed head distribution, sampled on the draft vocabulary only: small [B, N]
    fp32 logits of the target ids ``vocab_ids`` [N] -> target ids [B]. The full-vocabulary logits verify() gets
    are -inf outside the draft vocabulary, so temperature, top-k, top-p and min-p keep the same tokens with the
    same probabilities here, and the Gumbel noise is keyed by the target id (as engine.step.sample_draft keys it):
    the law is the full vector's, at N / V of the sampling cost, in one kernel launch on a GPU
    (``verify.sampling.sample_keyed``; PyTorch's Philox over the row is ~150 small kernels per call)."""
    return sample_keyed(small, resolved, seeds, positions, rng.PURPOSE_EXTRA, ids=vocab_ids)


class HeadRunner(DraftRunner):
    """A head's per-generation device state (see the module docstring): fed by every verify forward (``observes``),
    never scores a chunk itself (context drafts are covered by ``observe``)."""

    observes = True
    row_buffers = ("k", "v")

    def __init__(self, head, batch: int, capacity: int, mode: str):
        self.head = head
        self.features = tuple(head.cfg.feature_layers)
        self.mode = mode
        self.capacity = capacity
        dtype = head.fc.weight.dtype
        self.device = head.fc.weight.device
        self.k, self.v = head.new_cache(batch, capacity, self.device, dtype)
        self.cache_version = 0
        self.compile_seconds = 0.0
        self._entries = head.entries
        if mode == "native-graphs":     # compiled (inductor fuses the norms, RoPE, cache write); eager on failure
            self._entries = _compiled_entries(head)

    def entries(self, feat, tokens, positions, mask, write_pos):
        if self._entries is not self.head.entries:
            if not isinstance(write_pos, torch.Tensor):     # the host path's int W: a tensor, or every W recompiles
                write_pos = torch.tensor(write_pos, dtype=torch.int64, device=tokens.device)
            try:
                return self._entries(feat, tokens, positions, mask, write_pos, self.k, self.v)
            except Exception as err:     # stay correct where inductor fails: the eager layer from now on
                warnings.warn(f"compiling the draft head failed ({type(err).__name__}: {err}); running it eagerly")
                self._entries = self.head.entries
        return self.head.entries(feat, tokens, positions, mask, write_pos, self.k, self.v)

    def prefill(self, ids, positions, mask, features, short: bool) -> torch.Tensor:
        """The head's entries for the prompts ``ids`` [B, P+1] at slots [0, P) from the features [B, P, n d] of the
        target's prefill: each position's features with the token after it (the last one: the pending token);
        positions [B, P], mask [B, 1, P, C] -> hidden [B, d]."""
        p = ids.shape[1] - 1
        feats = features
        next_tokens = ids[:, 1:p + 1]
        write = torch.zeros((), dtype=torch.int64, device=feats.device)
        # eager: prompt lengths vary, a compiled copy would recompile per length
        h = self.head.entries(self.head.fuse(feats), next_tokens, positions, mask, write, self.k, self.v)
        return h[:, -1].clone()

    def prefill_row(self, row, ids, positions, mask, write, features) -> torch.Tensor:
        """One prompt chunk of batch row ``row``: the head's entries at slots [write, write + q) of that row from the
        target's features [1, q, n d] of the chunk, each with the token after it (ids [1, q+1]) -> the output of
        the last entry [1, d]."""
        slot = torch.full((), write, dtype=torch.int64, device=ids.device)
        h = self.head.entries(self.head.fuse(features), ids[:, 1:], positions, mask, slot,
                              self.k[row:row + 1], self.v[row:row + 1])
        return h[:, -1].clone()

    def empty_state(self, batch: int) -> torch.Tensor:
        return torch.zeros((batch, self.head.cfg.hidden), dtype=self.k.dtype, device=self.device)

    def propose(self, view: StepView, gamma: int, resolved, greedy: bool, ex) -> Proposal:
        """γ draft tokens from ``view.hidden`` -> Proposal(tokens [B, γ], logits [B, γ, V] fp32 or None when
        greedy); token i is sampled at position seq_len - 1 + i on the draft vocabulary (:func:`_sample_draft_vocab`;
        the head runs its own layer in either execution)."""
        head = self.head
        valid, seeds, write = view.valid, view.seeds, view.write
        pos0 = view.seq_len - 1
        tokens, all_logits = [], []
        h = view.hidden
        for i in range(1, gamma + 1):
            small = head.logits(h)
            if greedy:
                tok = head.vocab_ids[ex.argmax(small)]     # a captured step's: split over many programs
            else:
                tok = _sample_draft_vocab(small.float(), head.vocab_ids, resolved, seeds, pos0 + i)
                all_logits.append(head.full_logits(small))
            tokens.append(tok)
            if i < gamma:     # the entry at position pos0 + i - 1 (slot W + i - 1): (own output, token i)
                slot = write + (i - 1)
                h = self.entries(h[:, None], tok[:, None], (pos0 + i - 1)[:, None],
                                 chunk_mask(valid, write, slot, 1), slot)[:, 0]
        draft = torch.stack(tokens, dim=1)
        return Proposal(draft, torch.stack(all_logits, dim=1) if all_logits else None)

    def observe(self, view: StepView, feats, out_tokens, num_emitted, ex) -> torch.Tensor:
        """Entries for the verified chunk [pending, d_1 .. d_K] at slots [W, W + K] (``valid`` / ``seq_len`` as
        before the commit): feats [B, K+1, n d], out_tokens [B, K+1] (-1 padded), num_emitted [B] -> new hidden
        [B, d] (the entry of the last accepted position; later entries lie in slots the commit leaves invalid)."""
        valid, seq_len, write = view.valid, view.seq_len, view.write
        q = out_tokens.shape[1]
        positions = (seq_len - 1)[:, None] + torch.arange(q, device=seq_len.device)[None, :]
        h = self.entries(self.head.fuse(feats), out_tokens.clamp(min=0), positions, chunk_mask(valid, write, write, q),
                         write)
        idx = (num_emitted - 1).clamp(min=0)[:, None, None].expand(-1, 1, h.shape[-1])
        return h.gather(1, idx)[:, 0]

    def select(self, rows: torch.Tensor, slot_index: torch.Tensor) -> None:
        for name in ("k", "v"):
            if gather_attr(self, name, rows, slot_index):
                self.cache_version += 1

    def memory_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


_COMPILED: dict = {}
_LOADED: dict = {}       # (head folder, id(target)) -> (weakref to the target, its loaded head)


def _compiled_entries(head):
    fn = _COMPILED.get(id(head))
    if fn is None or fn[0] is not head:
        fn = _COMPILED[id(head)] = (head, torch.compile(head.entries, fullgraph=True, dynamic=False))
    return fn[1]


class HeadDrafter(Drafter):
    """A trained draft head; ``head``: a DraftHead, a folder, or None (the default folder of the target, found when
    the decoder attaches it); ``context``: "ngram" / "suffix" / a ContextDrafter for ``head+ngram``."""

    kind = "head"

    def __init__(self, head=None, *, context=None):
        self.head = head if not isinstance(head, (str, Path)) else None
        self.folder = Path(head) if isinstance(head, (str, Path)) else None
        if isinstance(context, str):
            from . import CONTEXT_DRAFTERS
            if context not in CONTEXT_DRAFTERS:
                raise ValueError(f"unknown context drafter {context!r}; use one of {sorted(CONTEXT_DRAFTERS)}")
            context = CONTEXT_DRAFTERS[context]()
        if context is not None and not isinstance(context, ContextDrafter):
            raise TypeError(f"context must be 'ngram', 'suffix' or a ContextDrafter, got {type(context).__name__}")
        self.context = context

    @property
    def name(self) -> str:
        return "head" if self.context is None else f"head+{self.context.kind}"

    @property
    def has_context(self) -> bool:
        return self.context is not None

    @property
    def features(self) -> tuple:
        return tuple(self.head.cfg.feature_layers) if self.head is not None else ()

    def attach(self, target) -> None:
        """Load (if needed) and check the head against ``target``: the wrong target is an error, a missing head
        says how to train one."""
        from tilespec.heads.store import head_dir, load_head, target_identity, HeadMismatch

        if self.head is None:
            name = target_name(target)
            folder = Path(self.folder or head_dir(name)).resolve()
            key = (str(folder), id(target))
            cached = _LOADED.get(key)
            if cached is None or cached[0]() is not target:    # one loaded head per (folder, target) and process:
                head = load_head(folder, target, target_name=name)   # decoders share its compiled steps
                _LOADED[key] = cached = (weakref.ref(target), head)
            self.head = cached[1]
            return
        manifest = getattr(self.head, "manifest", None)
        if manifest is not None and manifest.get("target_id") != target_identity(target):
            raise HeadMismatch(f"this head was trained for target {manifest.get('target')!r}, not for this model")
        p = next(target.parameters())
        if self.head.fc.weight.device != p.device:
            raise ValueError(f"the head is on {self.head.fc.weight.device} but the target on {p.device}")
        if self.head.embed is None or self.head.embed.device != p.device:   # bound before the models moved
            self.head.bind(target)

    def start(self, prompts: Sequence[Sequence[int]]) -> Optional[ContextState]:
        return self.context.start(prompts) if self.context is not None else None

    def runner(self, batch: int, capacity: int, *, target, compile=None) -> HeadRunner:
        """The head's runner for one generation, in the target runner's mode; on the compiled paths shared per
        (head, batch, capacity) like the models' runners (engine/leases.py), so captured steps are reused across
        generations."""
        return self._shared_runner(batch, capacity, target.mode, ("head",), HeadRunner)

    def _shared_runner(self, batch: int, capacity: int, mode: str, role: tuple, make):
        from ..leases import _COMPILED_RUNNERS, in_use

        if mode == "eager":
            return make(self.head, batch, capacity, mode)
        key = (id(self.head), *role, capacity, batch, mode)
        cached = _COMPILED_RUNNERS.get(key)
        if cached is not None and cached.head is self.head and not in_use(cached):
            return cached
        runner = make(self.head, batch, capacity, mode)
        if cached is None or not in_use(cached):
            _COMPILED_RUNNERS[key] = runner
        return runner
