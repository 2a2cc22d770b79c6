"""A draft model's device side: :class:`ModelDraftRunner`, the :class:`~.base.DraftRunner` over the model's runner.

Drafting (``propose``): γ autoregressive forwards with the draft's slot cache. The first forward re-feeds
[prev, pending] at slots [W-1, W] (see state.py: this rewrites the last accepted draft token whenever the target
accepted a whole block, so the cache is complete without an extra forward); forward i >= 1 feeds draft token i at
slot W + i. Slot W + γ (the last draft token) is filled by the next step's re-feed.
Scoring (``score``): when a context drafter proposed instead, the model sees the same chunk as the target,
[pending, d_1 .. d_K] at slots [W, W + K], so its cache stays complete for later model-drafted steps.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..slots import row_forward
from ..state import chunk_mask
from .contract import DraftRunner, Proposal, StepView


class ModelDraftRunner(DraftRunner):
    """The draft model's runner (``model_runner``: a ModelRunner or NativeRunner) as a drafter; runner attributes
    (``mode``, ``cache_version``, ``compile_seconds``, ``select``, ``memory_bytes``, ``encode``, ...) are the
    runner's own."""

    scores_context = True

    def __init__(self, model_runner):
        self.model_runner = model_runner
        self.runners = (model_runner,)

    def __getattr__(self, name):          # mode, cache_version, compile_seconds, capacity, ... of the runner
        if name == "model_runner":
            raise AttributeError(name)
        return getattr(self.model_runner, name)

    @property
    def mode(self) -> str:
        return self.model_runner.mode

    @property
    def cache_version(self) -> int:
        return getattr(self.model_runner, "cache_version", 0)

    @property
    def compile_seconds(self) -> float:
        return getattr(self.model_runner, "compile_seconds", 0.0)

    def select(self, rows: torch.Tensor, slot_index: torch.Tensor) -> None:
        self.model_runner.select(rows, slot_index)

    def memory_bytes(self) -> int:
        return self.model_runner.memory_bytes()

    shares_encoder = False      # the draft reuses the target's encoder weights (set per target, model_draft_runner)

    def encode(self, input_features: torch.Tensor, target_encoded: torch.Tensor) -> None:
        self.model_runner.encode(input_features, shared=target_encoded if self.shares_encoder else None)

    def prefill(self, ids, positions, mask, features, short: bool):
        p = ids.shape[1] - 1
        self.model_runner.forward(ids[:, :p], positions, mask, 0, keep=1,
                                  compiled=short and self.model_runner.mode == "native-graphs")
        return None

    def prefill_row(self, row, ids, positions, mask, write, features):
        row_forward(self.model_runner, row, ids[:, :-1], positions, mask, write)
        return None

    def propose(self, view: StepView, gamma: int, resolved, greedy: bool, ex) -> Proposal:
        """γ tokens -> Proposal(tokens [B, γ], logits [B, γ, V] fp32 or None when greedy); γ forwards."""
        runner, w, pos0 = self.model_runner, view.write, view.seq_len - 1   # pos0 [B]: position of pending
        tokens_in = torch.stack([view.prev, view.pending], dim=1)
        positions = torch.stack([(pos0 - 1).clamp(min=0), pos0], dim=1)
        logits = ex.forward(runner, tokens_in, positions, chunk_mask(view.valid, w, w - 1, 2), w - 1, keep=1)[:, 0]
        tokens, all_logits = [], []
        for i in range(1, gamma + 1):
            if not greedy:
                logits = logits.float()     # a no-op for the host path's float32 logits
            tok = ex.sample(logits, resolved, view.seeds, pos0 + i, greedy, runner.mode)
            tokens.append(tok)
            if not greedy:
                all_logits.append(logits)
            if i < gamma:
                logits = ex.forward(runner, tok[:, None], (pos0 + i)[:, None], chunk_mask(view.valid, w, w + i, 1),
                                    w + i)[:, 0]
        draft = torch.stack(tokens, dim=1)
        return Proposal(draft, torch.stack(all_logits, dim=1) if all_logits else None)

    def score(self, view: StepView, proposal: Proposal, ex) -> None:
        k = proposal.k
        tokens_in = torch.cat([view.pending[:, None], proposal.tokens], dim=1)
        positions = (view.seq_len - 1)[:, None] + torch.arange(k + 1, device=tokens_in.device)[None, :]
        ex.forward(self.model_runner, tokens_in, positions, chunk_mask(view.valid, view.write, view.write, k + 1),
                   view.write)


def check_draft_model(target, draft) -> None:
    """A draft model must match its target: both decoder-only or both encoder-decoder, one vocabulary, one device."""
    from ..runner import is_encoder_decoder

    if is_encoder_decoder(target) != is_encoder_decoder(draft):
        raise ValueError("target and draft must both be decoder-only or both encoder-decoder")
    tv = target.get_output_embeddings().weight.shape[0]
    dv = draft.get_output_embeddings().weight.shape[0]
    if tv != dv:
        raise ValueError(f"vocabulary mismatch: target has {tv} output tokens, draft has {dv}")
    t_dev, d_dev = next(target.parameters()).device, next(draft.parameters()).device
    if t_dev != d_dev:
        raise ValueError(f"target is on {t_dev} but draft on {d_dev}: move both to one device, "
                         f"e.g. draft.to(target.device)")


def as_draft_runner(model_runner) -> Optional[ModelDraftRunner]:
    """The one :class:`ModelDraftRunner` of a model runner (kept on it, so a shared compiled runner keeps one
    drafter, and the captured steps keyed by it are reused across generations); None for None."""
    if model_runner is None:
        return None
    wrapper = model_runner.__dict__.get("_draft_runner")
    if wrapper is None:
        wrapper = model_runner.__dict__["_draft_runner"] = ModelDraftRunner(model_runner)
    return wrapper


def model_draft_runner(model, batch: int, capacity: int, *, target, compile) -> ModelDraftRunner:
    """The draft model's runner for one generation (shared per shape on the compiled paths, engine/leases.py)."""
    from ..leases import shared_runner
    from ..runner import is_encoder_decoder, shares_encoder

    runner = as_draft_runner(shared_runner(model, "draft", capacity, batch, compile))
    runner.shares_encoder = is_encoder_decoder(model) and shares_encoder(target.model, model)
    return runner
