"""Self-distillation of a draft head (tilespec.heads.model) on the target's own responses: :func:`train_head`.

Budget split (``minutes``): responses ~30 % (head_data.generate_responses, the native runtime at a large batch, batches
cycling through ``sample_temperatures``), the target's features (one teacher-forced pass, kept on the device), then
training until the budget ends.
Loss per training-time-test step k (weights 0.8^(k-1); response positions, prompt positions weighted
``prompt_weight``): cross-entropy of the head's draft-vocabulary distribution
against the target's next-token distribution restricted (renormalised) to the draft vocabulary -- the best q on
that support for acceptance sum_v min(p, q) -- plus ``reg_weight`` × smooth-L1 between the head's normalised output
and the target's final normalised hidden state (EAGLE's feature regression), plus ``tv_weight`` × TV(p, q) at T = 1
(training.acceptance.total_variation): 1 - the acceptance of exact speculative sampling at T = 1, with p the
target's FULL-vocabulary distribution (its mass outside the draft vocabulary counts as rejected; the term's value
is the rejection rate itself, and its gradient equals that of the renormalised form's). Cross-entropy (forward KL)
spreads q over all of p's support; TV pays only for the mass where q and p differ, which is what sampled
acceptance measures. AdamW over fp32 weights with bf16 autocast on CUDA, linear warm-up then cosine decay.
Held-out estimate (training.acceptance.held_out; every ``eval_every`` steps and at the end): the chain's tokens per
target forward τ(γ) walked along the held-out responses sampled at each setting (training.chain_walk: what live
decoding measures) and the per-depth acceptance a_k with τ(γ) = 1 + a_1 + a_1 a_2 + ...; greedy, at the end also at
T = 0.7 and 1 (and T 0.7 / top-k 20 / top-p 0.8), stored in the manifest as ``alpha_by_temperature`` /
``tau_by_temperature`` / ``alpha_by_sampling`` (the teacher-forced per-position averages under ``teacher_forced``).
Resumable: ``out/train-state.pt`` holds the responses, the head, the optimiser and the step; a rerun with the same
folder continues (``resume=True``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F

from .acceptance import EVAL_FILTERED, EVAL_TEMPERATURES, autocast_for, held_out, total_variation
from .head_data import generate_responses, offline_prompts, sequence_features, token_counts
from tilespec.heads.model import DraftHead, config_for
from tilespec.heads.store import head_dir, save_head, target_identity

STATE = "train-state.pt"
# the head's cost per draft token in target forwards: the prior of the suggested γ (a 1.5B target with a 32k draft
# vocabulary); the engine's ``optimal`` schedule measures it online
HEAD_COST = 0.05
# the highest response temperature accepted (beyond it a large-vocabulary target's samples are mostly noise)
MAX_SAMPLE_TEMPERATURE = 2.0


def _loss(head: DraftHead, data: dict, idx: torch.Tensor, steps: int, lm_rows: torch.Tensor, reg_weight: float,
          prompt_weight: float = 0.0, tv_weight: float = 0.0) -> torch.Tensor:
    """The training loss (module docstring) of rows ``idx`` of ``data`` (head_data.sequence_features; with
    ``tv_weight`` also ``data["log_mass"]`` [S, T] from :func:`draft_log_mass`, else the draft vocabulary is taken
    to hold all of the target's mass) -> a scalar."""
    feats, normed, toks = data["feats"][idx], data["normed"][idx], data["tokens"][idx]
    t = toks.shape[1]
    pos = torch.arange(t, device=toks.device)[None]
    nxt = torch.cat([toks[:, 1:], toks[:, -1:]], dim=1)              # entry e reads token e + 1
    outs = head.ttt_forward(head.fuse(feats), nxt, steps)
    # teacher for entry e: the target's distribution at position e + 1 (of token e + 2), on the draft vocabulary
    teach_h = torch.cat([normed[:, 1:], normed[:, -1:]], dim=1)
    teach = torch.log_softmax(F.linear(teach_h.to(lm_rows.dtype), lm_rows).float(), dim=-1)
    inside = pos + 2 < data["lengths"][idx, None]
    response = pos + 2 >= data["loss_from"][idx, None]
    weight = (inside & response).float() + prompt_weight * (inside & ~response).float()
    log_mass = None
    if tv_weight and "log_mass" in data:
        lm = data["log_mass"][idx]
        log_mass = torch.cat([lm[:, 1:], lm[:, -1:]], dim=1)
    total = 0.0
    for k, h in enumerate(outs, start=1):
        m = weight * (pos >= k - 1).float()
        denom = m.sum().clamp(min=1.0)
        logq = torch.log_softmax(head.logits(h).float(), dim=-1)
        ce = -(teach.exp() * logq).sum(-1)
        reg = F.smooth_l1_loss(head.normed(h).float(), teach_h.float(), reduction="none").mean(-1)
        term = ce + reg_weight * reg
        if tv_weight:
            term = term + tv_weight * total_variation(teach, logq, log_mass)
        total = total + 0.8 ** (k - 1) * ((term * m).sum() / denom)
    return total


@torch.no_grad()
def draft_log_mass(data: dict, lm_rows: torch.Tensor, full_lm: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """log of the target's T = 1 probability mass on the draft vocabulary at every position: data["normed"]
    [S, T, d], lm_rows [N, d] (the draft vocabulary's LM head rows), full_lm [V, d] -> [S, T] float32 (<= 0).
    One full-vocabulary pass over the data, ``batch`` rows at a time."""
    out = []
    for i in range(0, data["normed"].shape[0], batch):
        h = data["normed"][i:i + batch]
        out.append(torch.logsumexp(F.linear(h.to(lm_rows.dtype), lm_rows).float(), -1)
                   - torch.logsumexp(F.linear(h.to(full_lm.dtype), full_lm).float(), -1))
    return torch.cat(out).clamp(max=0.0)


@dataclass(frozen=True)
class HeadTrainConfig:
    """How :func:`train_head` trains (every field a keyword of ``train_head`` too).

    Budget: ``minutes`` in all, responses within ``data_share`` of it. Data: ``num_prompts`` offline prompts when
    none are given; responses of at most ``max_new_tokens`` (past the EOS with ``ignore_eos``) generated
    ``gen_batch`` at a time with the decoder's step mode ``compile``; rows of ``seq_len`` tokens. Head:
    ``draft_vocab`` the most frequent response tokens (None: the target's vocabulary); ``ttt_steps`` draft steps
    unrolled by the loss. Optimiser: ``batch`` rows a step, AdamW at ``lr`` with ``warmup`` linear steps then cosine
    decay; ``reg_weight`` weighs the feature regression, ``prompt_weight`` prompt positions (response positions weigh
    1). Run: at most ``max_steps`` steps (None: until the budget ends); the held-out estimate and a checkpoint every
    ``eval_every`` steps (0: at the end only); ``resume`` from ``out/train-state.pt``; ``seed``; a tqdm bar with
    ``progress``.

    ``sample_temperatures``: the temperatures of the response batches, in turn (batch j at T[j mod n]; a repeated
    value weighs it more, e.g. (0, 0, 1)). The loss is to the target's whole distribution at every position, so the
    temperature only picks the contexts the head sees. The default (0, 1) is greedy decoding's contexts and the
    widest ones sampling at T <= 1 reaches (T = 0.7 contexts lie between); it is what the measured heads were
    trained on. ``tv_weight``: the weight of the T = 1 total-variation term (0: cross-entropy alone).
    """
    minutes: float = 10.0
    data_share: float = 0.3
    num_prompts: int = 2000
    max_new_tokens: int = 256
    gen_batch: int = 64
    ignore_eos: bool = False
    compile: Union[str, bool] = "native"
    seq_len: int = 640
    draft_vocab: Optional[int] = 32000
    ttt_steps: int = 4
    batch: int = 8
    lr: float = 3e-4
    warmup: int = 50
    reg_weight: float = 0.1
    prompt_weight: float = 0.0
    max_steps: Optional[int] = None
    eval_every: int = 100
    resume: bool = True
    seed: int = 0
    progress: bool = True
    sample_temperatures: tuple = (0.0, 1.0)
    tv_weight: float = 0.0

    def __post_init__(self):
        temps = self.sample_temperatures
        if isinstance(temps, (int, float, str)) or not temps or not all(
                isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= MAX_SAMPLE_TEMPERATURE
                for t in temps):    # (NaN fails every comparison)
            raise ValueError(f"head training needs sample_temperatures: a non-empty sequence of numbers in "
                             f"[0, {MAX_SAMPLE_TEMPERATURE}] (0 = greedy), e.g. (0, 0.7, 1); got {temps!r}")
        object.__setattr__(self, "sample_temperatures", tuple(float(t) for t in temps))
        rules = (("minutes > 0", self.minutes > 0), ("0 <= data_share < 1", 0 <= self.data_share < 1),
                 ("seq_len >= 2", self.seq_len >= 2), ("ttt_steps >= 1", self.ttt_steps >= 1),
                 ("batch >= 1", self.batch >= 1), ("lr > 0", self.lr > 0), ("warmup >= 0", self.warmup >= 0),
                 ("eval_every >= 0", self.eval_every >= 0),
                 ("draft_vocab >= 1", self.draft_vocab is None or self.draft_vocab >= 1),
                 ("max_steps >= 0", self.max_steps is None or self.max_steps >= 0),
                 ("0 <= tv_weight < inf", 0 <= self.tv_weight < math.inf))
        bad = [name for name, ok in rules if not ok]
        if bad:
            raise ValueError(f"head training needs {', '.join(bad)}: {self}")


def train_head(target, tokenizer=None, *, target_name: str, config: Optional[HeadTrainConfig] = None, out=None,
               prompts=None, source: Optional[dict] = None, log=print, **settings) -> tuple[DraftHead, dict]:
    """Train a head for ``target`` and save it (``out``, default ``$TILESPEC_HOME/heads/<target_name>/``).

    config: a :class:`HeadTrainConfig`; ``settings`` (its field names) replace fields of it (or of the defaults).
    prompts: token-id lists, or user messages (str, with ``tokenizer``), or None (``data.offline_prompts``);
    source: what the given prompts are (recorded in the manifest). Returns (head, report): the report holds the
    data description, steps, tokens/s, held-out acceptance and the timings; also the manifest's.
    """
    cfg = replace(config or HeadTrainConfig(), **settings)
    t_start = time.perf_counter()
    budget = 60.0 * cfg.minutes
    dev = next(target.parameters()).device
    folder = Path(out) if out is not None else head_dir(target_name)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    saved = torch.load(folder / STATE, map_location="cpu", weights_only=False) \
        if cfg.resume and (folder / STATE).is_file() else None
    if saved is not None:
        seqs, source = saved["sequences"], saved["source"]
        log(f"resuming from {folder / STATE}: step {saved['step']}, {len(seqs.tokens)} responses")
    else:
        seqs, source = _responses(target, tokenizer, prompts, dict(source or {"kind": "given"}), cfg, budget, log)
    head = _head_for(target, seqs, cfg.draft_vocab, saved).to(dev)
    head.bind(target)
    head.train()
    t_feat = time.perf_counter()
    data = sequence_features(target, seqs, head.cfg.feature_layers, length=cfg.seq_len)
    full_lm = target.get_output_embeddings().weight.detach()
    if cfg.tv_weight and head.cfg.draft_vocab < head.cfg.vocab_size:
        data["log_mass"] = draft_log_mass(data, head.lm_rows, full_lm)
    feat_s = time.perf_counter() - t_feat
    held, train_rows = _split_rows(data["tokens"].shape[0], cfg.seed, dev)
    temps = getattr(seqs, "temperatures", None)       # responses saved before they were recorded: unknown
    row_temps = torch.tensor(temps, dtype=torch.float32) if temps and len(temps) == len(seqs.tokens) else None
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    step = 0
    if saved is not None:
        opt.load_state_dict(saved["opt"])
        step = saved["step"]

    def checkpoint(at: int, final: bool = False) -> dict:
        """The held-out estimate now (greedy; ``final``: also at the evaluation temperatures), and the state a
        rerun resumes from."""
        estimate = held_out(head, data, held, cfg.ttt_steps, full_lm,
                            temperatures=EVAL_TEMPERATURES if final else (), filtered=EVAL_FILTERED if final else None,
                            row_temperatures=row_temps)
        torch.save({"sequences": seqs, "source": source, "head": head.state_dict(), "opt": opt.state_dict(),
                    "step": at}, folder / STATE)
        return estimate

    deadline = t_start + budget - 10
    step, tokens_seen, train_s = _fit(head, opt, data, train_rows, cfg, step, deadline, checkpoint)
    estimate = checkpoint(step, final=True)
    from tilespec.engine.gamma import chain_gamma
    gamma, gain = chain_gamma(estimate["alpha_per_step"], HEAD_COST)
    estimate.update(suggested_gamma=gamma, predicted_speedup=round(gain, 3), assumed_cost_ratio=HEAD_COST)
    info = {"data": source, "steps": step, "ttt_steps": cfg.ttt_steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
            "lr": cfg.lr, "prompt_weight": cfg.prompt_weight, "tv_weight": cfg.tv_weight,
            "train_tokens": tokens_seen, "train_seconds": round(train_s, 1),
            "train_tokens_per_second": round(tokens_seen / max(train_s, 1e-9)),
            "feature_seconds": round(feat_s, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
            "held_out": estimate, "held_out_rows": int(held.numel()), "draft_vocab": head.cfg.draft_vocab,
            # per-depth acceptance at a temperature, for the engine's chain / tree shapes (a copy of held_out's)
            "alpha_by_temperature": estimate["alpha_by_temperature"],
            "tau_by_temperature": estimate["tau_by_temperature"]}
    _save_and_bind(head, target, target_name, folder, info)
    taus = {t: tau[cfg.ttt_steps] for t, tau in estimate["tau_by_temperature"].items()}
    log(f"head saved to {folder}: {step} steps, held-out α per step by temperature "
        f"{estimate['alpha_by_temperature']}, τ({cfg.ttt_steps}) {taus}")
    return head, info


def _responses(target, tokenizer, prompts, source: dict, cfg: HeadTrainConfig, budget: float, log):
    """The target's responses (head_data.Sequences) to ``prompts`` (None: offline prompts; text: chat-encoded with
    ``tokenizer``) within ``data_share`` of ``budget`` seconds, and ``source`` updated with what they are."""
    if prompts is None:
        prompts, counts = offline_prompts(cfg.num_prompts, seed=cfg.seed)
        source = {"kind": "offline-prompts", "counts": counts}
    if prompts and isinstance(prompts[0], str):
        if tokenizer is None:
            raise ValueError("text prompts need a tokenizer")
        from tilespec.engine.prompts import encode_prompts
        prompts = encode_prompts(tokenizer, prompts, chat=True)
    seqs = generate_responses(target, prompts, max_new_tokens=cfg.max_new_tokens, batch=cfg.gen_batch,
                              compile=cfg.compile, budget_s=cfg.data_share * budget, seed=cfg.seed, log=log,
                              ignore_eos=cfg.ignore_eos, temperatures=cfg.sample_temperatures)
    source.update(ignore_eos=cfg.ignore_eos, prompts=len(seqs.tokens), response_tokens=seqs.new_tokens,
                  max_new_tokens=cfg.max_new_tokens, generation_seconds=round(seqs.seconds, 1),
                  sampling="batches cycle T = " + " / ".join(f"{t:g}" for t in cfg.sample_temperatures))
    return seqs, source


def _head_for(target, seqs, draft_vocab: Optional[int], saved: Optional[dict]) -> DraftHead:
    """A head of the target's shape over min(draft_vocab, V) ids: the checkpoint's, else a fresh one over the
    responses' most frequent tokens (sorted ids), initialised from the target."""
    vocab = target.get_output_embeddings().weight.shape[0]
    n_vocab = min(draft_vocab or vocab, vocab)
    if saved is not None:
        head = DraftHead(config_for(target, draft_vocab=n_vocab), vocab_ids=saved["head"]["vocab_ids"])
        head.load_state_dict(saved["head"])
        return head
    ids = torch.sort(torch.topk(token_counts(seqs, vocab), n_vocab).indices).values
    head = DraftHead(config_for(target, draft_vocab=n_vocab), vocab_ids=ids)
    head.init_from(target)
    return head


def _split_rows(n: int, seed: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(held-out rows, training rows) of ``n`` rows, a seeded permutation: 1/20 held out (at least one; with a
    single row it is also the training row)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(dev)
    n_held = max(1, n // 20)
    return perm[:n_held], perm[n_held:] if n > n_held else perm


def _lr_factor(step: int, warmup: int, total: int) -> float:
    """The learning rate's multiplier at ``step``: linear warm-up over ``warmup`` steps, then a cosine from 1 to 0.1
    at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))


def _fit(head: DraftHead, opt, data: dict, rows: torch.Tensor, cfg: HeadTrainConfig, step: int, deadline: float,
         checkpoint) -> tuple[int, int, float]:
    """Optimiser steps on random batches of ``rows`` from ``step`` until ``cfg.max_steps`` or ``deadline``
    (perf_counter seconds); ``checkpoint(step)`` every ``eval_every`` steps returns the held-out estimate shown on
    the bar. The cosine's length: ``max_steps``, else the pace of the first 5 steps. -> (step, tokens, seconds)."""
    params = [p for group in opt.param_groups for p in group["params"]]
    dev = rows.device
    total, first, estimate, tokens = cfg.max_steps or 10 ** 9, step, None, 0
    bar = None
    if cfg.progress:
        from tqdm.auto import tqdm
        bar = tqdm(desc="train head", unit="step", total=cfg.max_steps, leave=True)
    t0 = time.perf_counter()
    while (cfg.max_steps is None or step < cfg.max_steps) and time.perf_counter() <= deadline:
        idx = rows[torch.randint(len(rows), (cfg.batch,), device=dev)]
        for g in opt.param_groups:
            g["lr"] = cfg.lr * _lr_factor(step, cfg.warmup, total)
        with autocast_for(dev):
            loss = _loss(head, data, idx, cfg.ttt_steps, head.lm_rows, cfg.reg_weight, cfg.prompt_weight,
                         cfg.tv_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        tokens += int(data["lengths"][idx].sum())
        if step - first == 5 and cfg.max_steps is None:       # the cosine's length from the pace
            per_step = (time.perf_counter() - t0) / 5
            total = step + int(max(0.0, deadline - time.perf_counter()) / per_step)
        if bar is not None:
            post = {"loss": f"{float(loss):.3f}", "tok/s": f"{tokens / max(1e-9, time.perf_counter() - t0):.0f}"}
            if estimate:
                post.update({"α1": estimate["alpha_per_step"][0], "τ": estimate["tau"][cfg.ttt_steps]})
            bar.set_postfix(post, refresh=False)
            bar.update(1)
        if cfg.eval_every and step % cfg.eval_every == 0:
            estimate = checkpoint(step)
    if bar is not None:
        bar.close()
    return step, tokens, time.perf_counter() - t0


def _save_and_bind(head: DraftHead, target, target_name: str, folder: Path, info: dict) -> None:
    """Save a CPU copy of ``head`` in the target's dtype with its manifest (``info``) into ``folder``; the trained
    head itself becomes the engine's: frozen, in the target's dtype, bound to it, with the manifest attached."""
    tid = target_identity(target)
    dtype = next(target.parameters()).dtype
    final = DraftHead(head.cfg, vocab_ids=head.vocab_ids.cpu())
    final.load_state_dict({k: v.detach().cpu() for k, v in head.state_dict().items()})
    final.to(dtype=dtype)
    save_head(final, folder, target_id=tid, target_name=target_name, info=info)
    head.eval()
    head.requires_grad_(False)
    head.to(dtype=dtype)
    head.bind(target)
    head.manifest = {"target_id": tid, "target": target_name, **info}
