"""A Distil-Whisper-style draft for a Whisper target, trained by the library (a CPU-scale proof of concept).

:func:`student` builds the draft: a model of the target's class whose config has ``len(layers)`` decoder layers,
holding *copies* of the target's decoder layers at ``layers`` (Distil-Whisper initialises from the first and the
last) and of its final decoder layer norm -- the trainable part -- while the encoder, the token and position
embeddings and the LM head (tied to the embeddings) are the target's own modules (shared storage, frozen). Because
the encoder is shared, the engine reuses the target's encoder output for the draft (``runner.shares_encoder``).

:func:`pseudo_labels` decodes the target's own greedy transcripts (target-only, with the engine); :func:`distill`
trains the copies by teacher forcing on them with loss KL(p_target || p_draft) per position (Distil-Whisper's KL
term; its pseudo-label cross-entropy term is the same target at T = 0 and is left out), AdamW with linear warm-up
and cosine decay. Shapes: encoder states [N, frames, d_model] (the target encoder's output per clip), sequences
N token lists (decoder prefix + transcript, EOS included).
"""
from __future__ import annotations

import copy
import math
import random
from typing import Callable, Optional, Sequence

import torch
from torch import nn


def _check_whisper(target) -> nn.Module:
    if getattr(getattr(target, "config", None), "model_type", None) != "whisper":
        raise ValueError(f"a distilled Whisper draft needs a WhisperForConditionalGeneration, got "
                         f"{type(target).__name__}")
    return target.model.decoder


def student(target, layers: Optional[Sequence[int]] = None) -> nn.Module:
    """The draft: copies of the target's decoder layers ``layers`` (default: first and last) and final norm, the
    rest shared with ``target``. Raises ValueError for a non-Whisper target or layer indices out of range."""
    stack = _check_whisper(target)
    total = len(stack.layers)
    layers = tuple(layers) if layers is not None else (0, total - 1)
    if not layers or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < total for i in layers):
        raise ValueError(f"layers must be indices in [0, {total}) of {type(target).__name__}'s decoder, got {layers!r}")
    cfg = copy.deepcopy(target.config)
    cfg.decoder_layers = len(layers)
    with torch.device("meta"):
        draft = type(target)(cfg)
    for name, child in stack.named_children():
        if name not in ("layers", "layer_norm"):
            setattr(draft.model.decoder, name, child)
    copies = [copy.deepcopy(stack.layers[i]) for i in layers]
    for j, layer in enumerate(copies):          # the draft's cache has len(layers) layers
        for attn in (layer.self_attn, layer.encoder_attn):
            attn.layer_idx = j
    draft.model.decoder.layers = nn.ModuleList(copies)
    draft.model.decoder.layer_norm = copy.deepcopy(stack.layer_norm)
    draft.model.encoder = target.model.encoder
    draft.proj_out = target.proj_out
    left = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.device.type == "meta"]
    if left:
        raise RuntimeError(f"distilled draft of {type(target).__name__} left unbuilt tensors: {left[:5]}")
    draft.generation_config = copy.deepcopy(target.generation_config)
    draft.tilespec_distilled = {"layers": list(layers), "total": total}
    return draft.train(target.training)


def trainable(draft) -> list:
    """The draft's own parameters (decoder layer copies and final norm), the ones :func:`distill` trains."""
    return [*draft.model.decoder.layers.parameters(), *draft.model.decoder.layer_norm.parameters()]


@torch.inference_mode()
def pseudo_labels(target, features: torch.Tensor, prefix: Sequence[int], max_new_tokens: int,
                  batch_size: int = 8) -> list:
    """The target's greedy transcripts of ``features`` [N, mels, frames] as full decoder sequences (prefix +
    tokens), decoded target-only with the engine."""
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    dec = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy())
    out = []
    for start in range(0, features.shape[0], batch_size):
        chunk = features[start:start + batch_size]
        gen = dec.generate([list(prefix)] * chunk.shape[0], max_new_tokens=max_new_tokens, input_features=chunk)
        out += [list(prefix) + s for s in gen.sequences]
    return out


@torch.inference_mode()
def encoder_states(target, features: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """The target encoder's output [N, frames, d_model] for ``features`` [N, mels, frames]."""
    enc = target.model.encoder
    return torch.cat([enc(features[i:i + batch_size]).last_hidden_state
                      for i in range(0, features.shape[0], batch_size)])


def _batch(sequences: list, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and the mask [B, L - 1] of positions whose next token is real."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros(len(sequences), width - 1, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.as_tensor(s)
        mask[i, :len(s) - 1] = True
    return ids, mask


def distill(target, draft, states: torch.Tensor, sequences: list, *, prefix_len: int, steps: int = 200,
            lr: float = 1e-3, batch_size: int = 8, warmup: int = 20, seed: int = 0,
            log: Optional[Callable[[int, float], None]] = None) -> list:
    """Train ``draft``'s own parameters for ``steps`` AdamW steps on KL(p_target || p_draft) over the transcript
    positions of ``sequences`` (the first ``prefix_len`` - 1 positions predict the forced prefix and are skipped).
    Returns the loss per step. The target is left as it was (its parameters get no gradients)."""
    if len(sequences) != states.shape[0] or not sequences:
        raise ValueError(f"{states.shape[0]} encoder states for {len(sequences)} sequences")
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"steps, batch_size and lr must be positive, got {steps}, {batch_size}, {lr}")
    params = trainable(draft)
    frozen = [p for p in target.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)) * 0.5 * (
        1.0 + math.cos(math.pi * min(s / steps, 1.0))))
    pad = int(target.config.pad_token_id if target.config.pad_token_id is not None else 0)
    rng, losses = random.Random(seed), []
    was_training = draft.training
    draft.train()
    try:
        for step in range(steps):
            idx = [rng.randrange(len(sequences)) for _ in range(batch_size)]
            ids, mask = _batch([sequences[i] for i in idx], pad)
            mask[:, :prefix_len - 1] = False
            enc = states[idx]
            inputs = ids[:, :-1]
            with torch.no_grad():
                teacher = torch.log_softmax(target(encoder_outputs=(enc,), decoder_input_ids=inputs).logits.float(), -1)
            logp = torch.log_softmax(draft(encoder_outputs=(enc,), decoder_input_ids=inputs).logits.float(), -1)
            kl = (teacher.exp() * (teacher - logp)).sum(-1)
            loss = kl[mask].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if log is not None:
                log(step, losses[-1])
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for p in params:
            p.requires_grad_(False)
        draft.train(was_training)
    return losses
