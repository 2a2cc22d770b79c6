"""Self-distillation of a draft head (tilespec.heads.model) on the target's own responses: :func:`train_head`.

Budget split (``minutes``): responses ~30 % (head_data.generate_responses, the native runtime at a large batch), the
target's features (one teacher-forced pass, kept on the device), then training until the budget ends.
Loss per training-time-test step k (weights 0.8^(k-1); response positions, prompt positions weighted
``prompt_weight``): cross-entropy of the head's draft-vocabulary distribution
against the target's next-token distribution restricted (renormalised) to the draft vocabulary -- the best q on
that support for acceptance sum_v min(p, q) -- plus ``reg_weight`` × smooth-L1 between the head's normalised output
and the target's final normalised hidden state (EAGLE's feature regression). AdamW over fp32 weights with bf16
autocast on CUDA, linear warm-up then cosine decay. Held-out estimate (every ``eval_every`` steps and at the end):
per step k the share of response positions where the head's argmax equals the target's (greedy acceptance of the
k-th draft token given the previous ones accepted), and τ(γ) = 1 + a_1 + a_1 a_2 + ... .
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

from .head_data import generate_responses, offline_prompts, sequence_features, token_counts
from tilespec.heads.model import DraftHead, config_for
from tilespec.heads.store import head_dir, save_head, target_identity

STATE = "train-state.pt"
# the head's cost per draft token in target forwards: the prior of the suggested γ (a 1.5B target with a 32k draft
# vocabulary); the engine's ``optimal`` schedule measures it online
HEAD_COST = 0.05


def _loss(head: DraftHead, data: dict, idx: torch.Tensor, steps: int, lm_rows: torch.Tensor, reg_weight: float,
          prompt_weight: float = 0.0) -> torch.Tensor:
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
    total = 0.0
    for k, h in enumerate(outs, start=1):
        m = weight * (pos >= k - 1).float()
        denom = m.sum().clamp(min=1.0)
        logq = torch.log_softmax(head.logits(h).float(), dim=-1)
        ce = -(teach.exp() * logq).sum(-1)
        reg = F.smooth_l1_loss(head.normed(h).float(), teach_h.float(), reduction="none").mean(-1)
        total = total + 0.8 ** (k - 1) * (((ce + reg_weight * reg) * m).sum() / denom)
    return total


@torch.no_grad()
def held_out(head: DraftHead, data: dict, rows: torch.Tensor, steps: int, full_lm: torch.Tensor,
             batch: int = 8) -> dict:
    """Greedy agreement with the target per draft step on held-out rows (target argmax over the FULL vocabulary;
    the head's over its draft vocabulary, mapped to ids) -> {"alpha_per_step", "tau": {γ: τ}}."""
    agree, count = [0.0] * steps, [0.0] * steps
    head.eval()
    for i in range(0, len(rows), batch):
        idx = rows[i:i + batch]
        toks, normed = data["tokens"][idx], data["normed"][idx]
        t = toks.shape[1]
        pos = torch.arange(t, device=toks.device)[None]
        nxt = torch.cat([toks[:, 1:], toks[:, -1:]], dim=1)
        with _autocast(toks.device):
            outs = head.ttt_forward(head.fuse(data["feats"][idx]), nxt, steps)
        teach_h = torch.cat([normed[:, 1:], normed[:, -1:]], dim=1)
        target_arg = F.linear(teach_h.to(full_lm.dtype), full_lm).argmax(-1)
        base = (pos + 2 < data["lengths"][idx, None]) & (pos + 2 >= data["loss_from"][idx, None])
        for k, h in enumerate(outs, start=1):
            m = base & (pos >= k - 1)
            mine = head.vocab_ids[head.logits(h.to(head.fc.weight.dtype)).argmax(-1)]
            agree[k - 1] += float(((mine == target_arg) & m).sum())
            count[k - 1] += float(m.sum())
    head.train()
    alpha = [a / max(c, 1.0) for a, c in zip(agree, count)]
    tau, run, out = 1.0, 1.0, {}
    for g, a in enumerate(alpha, start=1):
        run *= a
        tau += run
        out[g] = round(tau, 3)
    return {"alpha_per_step": [round(a, 4) for a in alpha], "tau": out, "positions": int(count[0])}


def _autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


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

    def __post_init__(self):
        rules = (("minutes > 0", self.minutes > 0), ("0 <= data_share < 1", 0 <= self.data_share < 1),
                 ("seq_len >= 2", self.seq_len >= 2), ("ttt_steps >= 1", self.ttt_steps >= 1),
                 ("batch >= 1", self.batch >= 1), ("lr > 0", self.lr > 0), ("warmup >= 0", self.warmup >= 0),
                 ("eval_every >= 0", self.eval_every >= 0),
                 ("draft_vocab >= 1", self.draft_vocab is None or self.draft_vocab >= 1),
                 ("max_steps >= 0", self.max_steps is None or self.max_steps >= 0))
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
    feat_s = time.perf_counter() - t_feat
    held, train_rows = _split_rows(data["tokens"].shape[0], cfg.seed, dev)
    full_lm = target.get_output_embeddings().weight.detach()
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
    step = 0
    if saved is not None:
        opt.load_state_dict(saved["opt"])
        step = saved["step"]

    def checkpoint(at: int) -> dict:
        """The held-out estimate now, and the state a rerun resumes from."""
        estimate = held_out(head, data, held, cfg.ttt_steps, full_lm)
        torch.save({"sequences": seqs, "source": source, "head": head.state_dict(), "opt": opt.state_dict(),
                    "step": at}, folder / STATE)
        return estimate

    deadline = t_start + budget - 10
    step, tokens_seen, train_s = _fit(head, opt, data, train_rows, cfg, step, deadline, checkpoint)
    estimate = checkpoint(step)
    from tilespec.engine.gamma import chain_gamma
    gamma, gain = chain_gamma(estimate["alpha_per_step"], HEAD_COST)
    estimate.update(suggested_gamma=gamma, predicted_speedup=round(gain, 3), assumed_cost_ratio=HEAD_COST)
    info = {"data": source, "steps": step, "ttt_steps": cfg.ttt_steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
            "lr": cfg.lr, "prompt_weight": cfg.prompt_weight,
            "train_tokens": tokens_seen, "train_seconds": round(train_s, 1),
            "train_tokens_per_second": round(tokens_seen / max(train_s, 1e-9)),
            "feature_seconds": round(feat_s, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
            "held_out": estimate, "held_out_rows": int(held.numel()), "draft_vocab": head.cfg.draft_vocab}
    _save_and_bind(head, target, target_name, folder, info)
    log(f"head saved to {folder}: {step} steps, held-out α per step {estimate['alpha_per_step']}, "
        f"τ {estimate['tau']}")
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
                              ignore_eos=cfg.ignore_eos)
    source.update(ignore_eos=cfg.ignore_eos, prompts=len(seqs.tokens), response_tokens=seqs.new_tokens,
                  max_new_tokens=cfg.max_new_tokens, generation_seconds=round(seqs.seconds, 1),
                  sampling="alternate batches T=0 / T=1")
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
        with _autocast(dev):
            loss = _loss(head, data, idx, cfg.ttt_steps, head.lm_rows, cfg.reg_weight, cfg.prompt_weight)
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
