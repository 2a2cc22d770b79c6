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
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from .head_data import Sequences, generate_responses, offline_prompts, sequence_features, token_counts
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


def train_head(target, tokenizer=None, *, target_name: str, minutes: float = 10.0, out=None, prompts=None,
               num_prompts: int = 2000, max_new_tokens: int = 256, gen_batch: int = 64, seq_len: int = 640,
               draft_vocab: Optional[int] = 32000, ttt_steps: int = 4, batch: int = 8, lr: float = 3e-4,
               warmup: int = 50, reg_weight: float = 0.1, max_steps: Optional[int] = None, data_share: float = 0.3,
               eval_every: int = 100, resume: bool = True, compile="native", seed: int = 0, log=print,
               progress: bool = True, source: Optional[dict] = None, prompt_weight: float = 0.0,
               ignore_eos: bool = False) -> tuple[DraftHead, dict]:
    """Train a head for ``target`` and save it (``out``, default ``$TILESPEC_HOME/heads/<target_name>/``).

    prompts: token-id lists, or user messages (str, with ``tokenizer``), or None (``data.offline_prompts``);
    source: what the given prompts are (recorded in the manifest). prompt_weight: loss weight of prompt positions
    (the target's distribution there is a valid signal too; response positions weigh 1). ignore_eos: responses run
    to max_new_tokens past the EOS (data.generate_responses).
    max_steps: stop after that many optimiser steps even with budget left (tests). Returns (head, report): the
    report holds the data description, steps, tokens/s, held-out acceptance and the timings; also the manifest's.
    """
    t_start = time.perf_counter()
    budget = 60.0 * minutes
    dev = next(target.parameters()).device
    folder = Path(out) if out is not None else head_dir(target_name)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    saved = torch.load(folder / STATE, map_location="cpu", weights_only=False) \
        if resume and (folder / STATE).is_file() else None
    source = dict(source or {"kind": "given"})
    if saved is not None:
        seqs, source = saved["sequences"], saved["source"]
        log(f"resuming from {folder / STATE}: step {saved['step']}, {len(seqs.tokens)} responses")
    else:
        if prompts is None:
            texts, counts = offline_prompts(num_prompts, seed=seed)
            source = {"kind": "offline-prompts", "counts": counts}
            prompts = texts
        if prompts and isinstance(prompts[0], str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer")
            from tilespec.engine.prompts import encode_prompts
            prompts = encode_prompts(tokenizer, prompts, chat=True)
        seqs = generate_responses(target, prompts, max_new_tokens=max_new_tokens, batch=gen_batch, compile=compile,
                                  budget_s=data_share * budget, seed=seed, log=log, ignore_eos=ignore_eos)
        source.update(ignore_eos=ignore_eos, prompts=len(seqs.tokens), response_tokens=seqs.new_tokens,
                      max_new_tokens=max_new_tokens, generation_seconds=round(seqs.seconds, 1),
                      sampling="alternate batches T=0 / T=1")
    vocab = target.get_output_embeddings().weight.shape[0]
    n_vocab = min(draft_vocab or vocab, vocab)
    if saved is not None:
        head = DraftHead(config_for(target, draft_vocab=n_vocab), vocab_ids=saved["head"]["vocab_ids"])
        head.load_state_dict(saved["head"])
    else:
        ids = torch.sort(torch.topk(token_counts(seqs, vocab), n_vocab).indices).values
        head = DraftHead(config_for(target, draft_vocab=n_vocab), vocab_ids=ids)
        head.init_from(target)
    head.to(dev)
    head.bind(target)
    head.train()
    t_feat = time.perf_counter()
    data = sequence_features(target, seqs, head.cfg.feature_layers, length=seq_len)
    feat_s = time.perf_counter() - t_feat
    n = data["tokens"].shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(dev)
    n_held = max(1, n // 20)
    held, train_rows = perm[:n_held], perm[n_held:] if n > n_held else perm
    lm_rows = head.lm_rows
    full_lm = target.get_output_embeddings().weight.detach()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if saved is not None:
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
    left = budget - (time.perf_counter() - t_start)
    per_step = None
    est_total = max_steps or 10 ** 9

    def lr_at(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        frac = min(1.0, (s - warmup) / max(1, est_total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(desc="train head", unit="step", total=max_steps, leave=True)
    first_step = step
    t_train, tokens_seen, report_eval = time.perf_counter(), 0, None
    loop_start = t_train
    while True:
        if max_steps is not None and step >= max_steps:
            break
        elapsed = time.perf_counter() - t_start
        if elapsed > budget - 10:
            break
        idx = train_rows[torch.randint(len(train_rows), (batch,), device=dev)]
        for g in opt.param_groups:
            g["lr"] = lr * lr_at(step)
        with _autocast(dev):
            loss = _loss(head, data, idx, ttt_steps, lm_rows, reg_weight, prompt_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        tokens_seen += int(data["lengths"][idx].sum())
        if per_step is None and step - first_step == 5 and max_steps is None:   # the cosine's length from the pace
            per_step = (time.perf_counter() - loop_start) / 5
            est_total = step + int(max(0.0, budget - 10 - (time.perf_counter() - t_start)) / per_step)
        if bar is not None:
            tps = tokens_seen / max(1e-9, time.perf_counter() - t_train)
            post = {"loss": f"{float(loss):.3f}", "tok/s": f"{tps:.0f}"}
            if report_eval:
                post["α1"] = report_eval["alpha_per_step"][0]
                post["τ"] = report_eval["tau"][ttt_steps]
            bar.set_postfix(post, refresh=False)
            bar.update(1)
        if eval_every and step % eval_every == 0:
            report_eval = held_out(head, data, held, ttt_steps, full_lm)
            torch.save({"sequences": seqs, "source": source, "head": head.state_dict(), "opt": opt.state_dict(),
                        "step": step}, folder / STATE)
    if bar is not None:
        bar.close()
    train_s = time.perf_counter() - t_train
    report_eval = held_out(head, data, held, ttt_steps, full_lm)
    torch.save({"sequences": seqs, "source": source, "head": head.state_dict(), "opt": opt.state_dict(),
                "step": step}, folder / STATE)
    from tilespec.engine.gamma import chain_gamma
    gamma, gain = chain_gamma(report_eval["alpha_per_step"], HEAD_COST)
    report_eval.update(suggested_gamma=gamma, predicted_speedup=round(gain, 3), assumed_cost_ratio=HEAD_COST)
    tid = target_identity(target)
    info = {"data": source, "steps": step, "ttt_steps": ttt_steps, "batch": batch, "seq_len": seq_len, "lr": lr,
            "prompt_weight": prompt_weight,
            "train_tokens": tokens_seen, "train_seconds": round(train_s, 1),
            "train_tokens_per_second": round(tokens_seen / max(train_s, 1e-9)),
            "feature_seconds": round(feat_s, 1), "total_seconds": round(time.perf_counter() - t_start, 1),
            "held_out": report_eval, "held_out_rows": int(n_held), "draft_vocab": n_vocab}
    final = DraftHead(head.cfg, vocab_ids=head.vocab_ids.cpu())
    final.load_state_dict({k: v.detach().cpu() for k, v in head.state_dict().items()})
    final.to(dtype=next(target.parameters()).dtype)
    save_head(final, folder, target_id=tid, target_name=target_name, info=info)
    head.eval()
    head.requires_grad_(False)
    head.to(dtype=next(target.parameters()).dtype)
    head.bind(target)
    head.manifest = {"target_id": tid, "target": target_name, **info}
    log(f"head saved to {folder}: {step} steps, held-out α per step {report_eval['alpha_per_step']}, "
        f"τ {report_eval['tau']}")
    return head, info
