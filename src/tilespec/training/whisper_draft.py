"""Distillation of a Distil-Whisper-style draft (tilespec.models.distilled) on a Whisper target's own transcripts.

:func:`pseudo_labels` decodes the target's transcripts (target-only, with the engine): greedy ones, or samples at a
temperature, several per clip; :func:`distill` trains the draft's own weights (decoder layer copies, final norm) by
teacher forcing on them with loss KL(p_target || p_draft) per transcript position -- the target's full distribution
at every position of the (greedy or sampled) sequence is the teacher (Distil-Whisper's KL term; its pseudo-label
cross-entropy term is the same target at T = 0 and is left out) -- AdamW with linear warm-up and cosine decay to a
tenth, bf16 autocast on CUDA; :func:`agreement` measures, on held-out clips, where the draft's greedy token equals the
target's along the target's transcript -- exactly the greedy acceptance of a draft chain -- and the tokens per target
step that gives at each γ (acceptance at T > 0: whisper_acceptance.py).
Shapes: encoder states [N, frames, d_model] (the target encoder's output per clip), sequences M token lists (decoder
prefix + transcript, EOS included), ``owners`` M ints (the clip, i.e. the row of the states, of each sequence;
default: sequence i belongs to clip i).
"""
from __future__ import annotations

import math
import random
import time
from typing import Callable, Optional, Sequence

import torch

from tilespec.models.distilled import student, trainable  # noqa: F401  (student: the architecture, re-exported)


@torch.inference_mode()
def pseudo_labels(target, features: torch.Tensor, prefix: Sequence[int], max_new_tokens: int,
                  batch_size: int = 8, compile=False, temperature: float = 0.0, samples: int = 1,
                  seed=0) -> list:
    """The target's transcripts of ``features`` [N, mels, frames] as full decoder sequences (prefix + tokens),
    decoded target-only with the engine (``compile``: its step mode). ``temperature`` 0: the greedy transcript, one
    per clip (``samples`` must be 1); > 0: ``samples`` transcripts per clip sampled at that temperature, clip-major
    (clip i's samples are entries i * samples .. (i + 1) * samples - 1), every row with its own random stream:
    ``seed`` an int gives row r the request seed ``seed`` + r, a list gives each row its own (N * samples seeds), so
    two samples of one clip differ. ``batch_size``: clips per decode batch (it decodes ``batch_size * samples``
    rows)."""
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    temperature = float(temperature)
    if not (math.isfinite(temperature) and temperature >= 0.0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
    if not isinstance(samples, int) or samples < 1 or (temperature == 0.0 and samples != 1):
        raise ValueError(f"samples must be an integer >= 1 (exactly 1 at temperature 0: greedy decoding gives one "
                         f"transcript per clip), got {samples!r} at temperature {temperature}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    rows = features.shape[0] * samples
    seeds = [int(seed) + r for r in range(rows)] if isinstance(seed, int) else [int(x) for x in seed]
    if len(seeds) != rows:
        raise ValueError(f"{len(seeds)} seeds for {rows} rows ({features.shape[0]} clips x {samples} samples)")
    sampling = SamplingParams.greedy() if temperature == 0.0 else SamplingParams(temperature=temperature)
    dec = SpeculativeDecoder(target, None, sampling=sampling, compile=compile)
    out = []
    for start in range(0, features.shape[0], batch_size):
        chunk = features[start:start + batch_size].repeat_interleave(samples, dim=0)
        gen = dec.generate([list(prefix)] * chunk.shape[0], max_new_tokens=max_new_tokens, input_features=chunk,
                           seed=seeds[start * samples:start * samples + chunk.shape[0]])
        out += [list(prefix) + s for s in gen.sequences]
    return out


@torch.inference_mode()
def encoder_states(target, features: torch.Tensor, batch_size: int = 8) -> torch.Tensor:
    """The target encoder's output [N, frames, d_model] for ``features`` [N, mels, frames]."""
    enc = target.model.encoder
    return torch.cat([enc(features[i:i + batch_size]).last_hidden_state
                      for i in range(0, features.shape[0], batch_size)])


def _batch(sequences: list, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, L] and the mask [B, L - 1] of positions whose next token is real."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros(len(sequences), width - 1, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.as_tensor(s)
        mask[i, :len(s) - 1] = True
    return ids.to(device), mask.to(device)


def _owners(states: torch.Tensor, sequences: list, owners: Optional[Sequence[int]]) -> torch.Tensor:
    """``owners`` checked against the states and sequences, as a long tensor on the states' device."""
    if not sequences:
        raise ValueError("no sequences to train on")
    if owners is None:
        if len(sequences) != states.shape[0]:
            raise ValueError(f"{states.shape[0]} encoder states for {len(sequences)} sequences (give owners= when "
                             f"several sequences share a clip)")
        owners = range(len(sequences))
    owners = torch.as_tensor(list(owners), dtype=torch.long)
    if owners.shape != (len(sequences),) or (owners.numel() and not 0 <= int(owners.min()) <= int(owners.max())
                                             < states.shape[0]):
        raise ValueError(f"owners must give each of the {len(sequences)} sequences a row of the "
                         f"{states.shape[0]} encoder states")
    return owners.to(states.device)


def _autocast(device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast(
        "cpu", enabled=False)


def _log_probs(model, enc, inputs) -> torch.Tensor:
    return torch.log_softmax(model(encoder_outputs=(enc,), decoder_input_ids=inputs).logits.float(), -1)


def distill(target, draft, states: torch.Tensor, sequences: list, *, prefix_len: int, steps: int = 200,
            lr: float = 1e-3, batch_size: int = 8, warmup: int = 20, seed: int = 0, seconds: Optional[float] = None,
            log: Optional[Callable[[int, float], None]] = None, start_step: int = 0, optimizer_state=None,
            keep_optimizer: Optional[list] = None, owners: Optional[Sequence[int]] = None) -> list:
    """Train ``draft``'s own parameters for ``steps`` AdamW steps (fewer when ``seconds`` run out: the cosine's
    length then follows the measured pace) on KL(p_target || p_draft) over the transcript positions of
    ``sequences`` (the first ``prefix_len`` - 1 positions predict the forced prefix and are skipped). Returns the loss
    per step. The target is left as it was (its parameters get no gradients). ``start_step`` / ``optimizer_state``
    resume a run; ``keep_optimizer`` (a list) receives the optimiser's final state; ``owners``: the row of
    ``states`` of each sequence (default: one state per sequence, in order). Sequences are drawn uniformly, so a
    clip with several sampled transcripts weighs that many times a clip with one."""
    owners = _owners(states, sequences, owners)
    if steps < 1 or batch_size < 1 or not lr > 0:
        raise ValueError(f"steps, batch_size and lr must be positive, got {steps}, {batch_size}, {lr}")
    t0 = time.perf_counter()
    params = trainable(draft)
    frozen = [p for p in target.parameters() if p.requires_grad and not p.is_inference()]
    for p in frozen:
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    if optimizer_state is not None:
        opt.load_state_dict(optimizer_state)
    total = steps

    def lr_at(s: int) -> float:
        ramp = min(1.0, (s + 1) / max(warmup, 1))
        return ramp * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(s / total, 1.0))))

    pad = int(target.config.pad_token_id if target.config.pad_token_id is not None else 0)
    rng, losses = random.Random(seed + start_step), []
    was_training = draft.training
    device = states.device
    draft.train()
    try:
        for step in range(start_step, steps):
            if seconds is not None and time.perf_counter() - t0 > seconds:
                break
            idx = [rng.randrange(len(sequences)) for _ in range(batch_size)]
            ids, mask = _batch([sequences[i] for i in idx], pad, device)
            mask[:, :prefix_len - 1] = False
            enc, inputs = states[owners[idx]], ids[:, :-1]
            for g in opt.param_groups:
                g["lr"] = lr * lr_at(step)
            with _autocast(device):
                with torch.no_grad():
                    teacher = _log_probs(target, enc, inputs)
                logp = _log_probs(draft, enc, inputs)
            kl = (teacher.exp() * (teacher - logp)).sum(-1)
            loss = kl[mask].mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            done = step + 1 - start_step
            if seconds is not None and done == 10:     # the cosine's length from the pace
                pace = (time.perf_counter() - t0) / done
                total = min(steps, step + 1 + int(max(0.0, seconds - (time.perf_counter() - t0)) / pace))
            if log is not None:
                log(step, losses[-1])
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for p in params:
            p.requires_grad_(False)
        draft.train(was_training)
    if keep_optimizer is not None:
        keep_optimizer.append(opt.state_dict())
    return losses


@torch.no_grad()
def agreement(target, draft, states: torch.Tensor, sequences: list, *, prefix_len: int, max_gamma: int = 8,
              batch_size: int = 16) -> dict:
    """Greedy agreement of ``draft`` with ``target`` along the transcripts ``sequences`` (teacher forced on the
    target's own tokens, so an agreement at a position is the greedy acceptance of a draft token there). Returns
    ``alpha`` (share of positions), ``alpha_per_step`` (P(draft k accepted | the first k - 1 were) for k <= max_gamma,
    from draft chains run along the sequences at γ = max_gamma), ``tokens_per_step`` {γ: tokens per target step}
    and ``positions``."""
    pad = int(target.config.pad_token_id if target.config.pad_token_id is not None else 0)
    rows = []
    was = draft.training
    draft.eval()
    for i in range(0, len(sequences), batch_size):
        seqs = sequences[i:i + batch_size]
        ids, mask = _batch(seqs, pad, states.device)
        with _autocast(states.device):
            t = _log_probs(target, states[i:i + batch_size], ids[:, :-1]).argmax(-1)
            d = _log_probs(draft, states[i:i + batch_size], ids[:, :-1]).argmax(-1)
        same = (t == d).cpu()
        for j, s in enumerate(seqs):
            rows.append(same[j, prefix_len - 1:len(s) - 1].tolist())
    draft.train(was)
    positions = sum(map(len, rows))
    alpha = sum(map(sum, rows)) / max(positions, 1)
    tokens, offered, taken = {}, [0] * max_gamma, [0] * max_gamma
    for g in range(1, max_gamma + 1):
        produced = steps = 0
        for agree in rows:
            pos = 0
            while pos < len(agree):
                n = 0
                while n < g and pos + n < len(agree) - 1 and agree[pos + n]:
                    n += 1
                if g == max_gamma:
                    for k in range(min(n + 1, g, len(agree) - 1 - pos)):
                        offered[k] += 1
                        taken[k] += int(k < n)
                produced, steps, pos = produced + n + 1, steps + 1, pos + n + 1
        tokens[g] = round(produced / max(steps, 1), 3)
    per_step = [round(taken[k] / offered[k], 4) if offered[k] else 0.0 for k in range(max_gamma)]
    return {"alpha": round(alpha, 4), "alpha_per_step": per_step, "tokens_per_step": tokens, "positions": positions}
