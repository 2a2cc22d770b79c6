"""How often a draft head's tokens would be accepted, at a sampling temperature: the held-out estimate of head training.

Exact speculative sampling accepts a draft token drawn from q with probability sum_v min(p(v), q(v)) = 1 - TV(p, q)
(Leviathan et al. 2023), p and q the target's and the draft's distributions after the same temperature and
filters. For a head with a reduced draft vocabulary (target ids ``vocab_ids``), q is zero outside it, so the sum
runs over the draft vocabulary with p the target's FULL-vocabulary probabilities there (the mass p puts outside
is never accepted). At temperature 0 both are one-hot at their (first) argmax: acceptance is argmax agreement.

:func:`held_out` runs the head's training-time test on held-out rows. Per depth k it has, for every response
position, both the expected acceptance sum_v min(p, q) given the data's own tokens (the "teacher-forced" average,
kept for reference) and min(1, q(x) / p(x)), the acceptance given the token x the data holds there. Live decoding
does not average positions uniformly: a step starts right after the previous step's rejection or bonus token, so
where acceptance is correlated along the text (hard and easy stretches) hard stretches are tried more often, and
the product formula 1 + a_1 + a_1 a_2 + ... over per-position averages overestimates (on a tiny target: 2.35
against a measured 2.05 tokens per forward at γ = 4, T = 0); and at T > 0 the contexts are the sampled ones, so
rows sampled greedily or at another temperature misstate them. The stored tau(gamma) is therefore the chain walked
along the rows sampled at that setting (:mod:`tilespec.training.chain_walk`, exact in law for live decoding of such
prompts), and alpha per depth is the one whose chain formula gives that tau.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tilespec.verify.distributions import log_probs
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

# the temperatures of ``alpha_by_temperature`` (key: the temperature as written by ``_temperature_key``)
EVAL_TEMPERATURES = (0.0, 0.7, 1.0)
# filtered settings of ``alpha_by_sampling``: Qwen2.5's recommended sampling (T 0.7, top-k 20, top-p 0.8), the same
# filters applied to the target's full-vocabulary row and to the head's draft-vocabulary row (as the engine does)
EVAL_FILTERED = {"t=0.7,top_k=20,top_p=0.8": SamplingParams(temperature=0.7, top_k=20, top_p=0.8)}


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, vocab_ids: Optional[torch.Tensor] = None,
               sampling: Optional[SamplingParams] = None) -> torch.Tensor:
    """Expected acceptance of one exactly verified draft token per position: sum_v min(p(v), q(v)).

    target_logits [P, V] (any float dtype), draft_logits [P, N] over the target ids ``vocab_ids`` [N] int64 (None:
    N == V, the identity) -> [P] float32 in [0, 1]. ``sampling`` (default greedy) is applied to both rows as
    ``tilespec.verify`` applies it: temperature, then top-k / top-p / min-p on each row (the draft's on its N
    logits, which is what filtering its full row with -inf outside the draft vocabulary keeps); temperature 0 gives
    one-hot rows at the first argmax, so the result is 1 where the argmaxes (as target ids) agree, else 0.
    """
    sampling = sampling or SamplingParams(temperature=0.0)
    if target_logits.ndim != 2 or draft_logits.ndim != 2 or target_logits.shape[0] != draft_logits.shape[0]:
        raise ValueError(f"acceptance needs target_logits [P, V] and draft_logits [P, N], got "
                         f"{tuple(target_logits.shape)} and {tuple(draft_logits.shape)}")
    n, v = draft_logits.shape[1], target_logits.shape[1]
    if vocab_ids is None and n != v:
        raise ValueError(f"draft logits over {n} ids need vocab_ids (the target ids of the draft vocabulary of {v})")
    if vocab_ids is not None and tuple(vocab_ids.shape) != (n,):
        raise ValueError(f"vocab_ids must be [N] = [{n}], got {tuple(vocab_ids.shape)}")
    if isinstance(sampling.temperature, (int, float)) and sampling.temperature == 0:
        mine = draft_logits.argmax(-1)
        mine = mine if vocab_ids is None else vocab_ids[mine]
        return (mine == target_logits.argmax(-1)).float()
    res = resolve_sampling(sampling, 1, target_logits.device)
    p = log_probs(target_logits[None], res)[0].exp()
    q = log_probs(draft_logits[None], res)[0].exp()
    if vocab_ids is not None:
        p = p.index_select(-1, vocab_ids.to(p.device))
    return torch.minimum(p, q).sum(-1)


def total_variation(teacher_logp: torch.Tensor, draft_logq: torch.Tensor,
                    log_mass: Optional[torch.Tensor] = None) -> torch.Tensor:
    """TV(p, q) = 1 - sum_v min(p(v), q(v)) over the FULL vocabulary, from draft-vocabulary rows: differentiable.

    teacher_logp [.., N]: the target's log-probabilities renormalised on the draft vocabulary; draft_logq [.., N]:
    the head's; log_mass [..] (None: 0): log of the target's full-vocabulary mass m on the draft vocabulary, so
    p(v) = m p_N(v) there and 1 - m outside (where q is 0). -> [..] = (sum_N |m p_N - q| + 1 - m) / 2 in [0, 1].
    """
    p = teacher_logp.float().exp()
    mass = torch.ones_like(p[..., 0]) if log_mass is None else log_mass.float().exp()
    return 0.5 * ((mass[..., None] * p - draft_logq.float().exp()).abs().sum(-1) + 1.0 - mass)


def tau_by_gamma(alphas: list) -> dict:
    """Per-depth acceptance [a_1, .., a_K] -> {gamma: tau(gamma)} for gamma = 1..K, tau = 1 + sum_g prod_{k<=g} a_k."""
    tau, run, out = 1.0, 1.0, {}
    for g, a in enumerate(alphas, start=1):
        run *= a
        tau += run
        out[g] = round(tau, 3)
    return out


def emitted_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, tokens: torch.Tensor,
                       vocab_ids: Optional[torch.Tensor] = None,
                       sampling: Optional[SamplingParams] = None) -> torch.Tensor:
    """Probability that the draft was accepted given the token the step emitted: min(1, q(x) / p(x)) per position.

    target_logits [P, V], draft_logits [P, N] over the target ids ``vocab_ids`` [N] (None: N == V), tokens [P]
    int64 target ids x -> [P] float32 in [0, 1]. With x drawn from p this averages to :func:`acceptance` (E_p
    min(1, q/p) = sum_v min(p, q)); rows and ``sampling`` as there. At temperature 0: whether the draft's argmax is x
    (the token itself, so a near-tie the target's recomputed logits break the other way does not count as a
    rejection); x with p(x) = 0 under ``sampling`` gives 0.
    """
    sampling = sampling or SamplingParams(temperature=0.0)
    if tuple(tokens.shape) != (target_logits.shape[0],):
        raise ValueError(f"tokens must be [P] = [{target_logits.shape[0]}], got {tuple(tokens.shape)}")
    acceptance(target_logits[:0], draft_logits[:0], vocab_ids, sampling)       # the shape checks
    ids = vocab_ids.to(tokens.device) if vocab_ids is not None else None
    if isinstance(sampling.temperature, (int, float)) and sampling.temperature == 0:
        mine = draft_logits.argmax(-1)
        return ((mine if ids is None else ids[mine]) == tokens).float()
    res = resolve_sampling(sampling, 1, target_logits.device)
    logp = log_probs(target_logits[None], res)[0].gather(-1, tokens[:, None])[:, 0]
    logq_rows = log_probs(draft_logits[None], res)[0]
    if ids is None:
        logq = logq_rows.gather(-1, tokens[:, None])[:, 0]
    else:
        column = torch.full((target_logits.shape[1],), -1, dtype=torch.int64, device=tokens.device)
        column[ids] = torch.arange(ids.numel(), device=tokens.device)
        col = column[tokens]
        logq = logq_rows.gather(-1, col.clamp(min=0)[:, None])[:, 0].masked_fill(col < 0, float("-inf"))
    ratio = torch.exp(torch.clamp(logq - logp, max=0.0))
    return torch.where(torch.isfinite(logp), ratio, torch.zeros_like(ratio))


def _temperature_key(t: float) -> str:
    return f"{t:g}"


def _sampled_at(sampling: SamplingParams, row_temperatures: Optional[torch.Tensor], tokens: torch.Tensor,
                min_positions: int) -> Optional[torch.Tensor]:
    """Rows whose responses were sampled at ``sampling`` (exact, unfiltered temperatures only), when they hold at
    least ``min_positions`` of the response tokens ``tokens`` [S]; else None."""
    if row_temperatures is None or sampling.top_k or sampling.top_p < 1 or sampling.min_p or sampling.lenience < 1:
        return None
    same = (row_temperatures - float(sampling.temperature)).abs() < 1e-6
    return same if int(tokens[same].sum()) >= max(1, min_positions) else None


@torch.no_grad()
def held_out(head, data: dict, rows: torch.Tensor, steps: int, full_lm: torch.Tensor, batch: int = 8,
             temperatures: tuple = (), filtered: Optional[dict] = None, chunk: int = 1024,
             row_temperatures: Optional[torch.Tensor] = None, min_positions: int = 512) -> dict:
    """The head's held-out acceptance per draft depth and the chain's tokens per forward (module docstring).

    head: a DraftHead bound to the target; data: ``head_data.sequence_features`` output (``tokens`` [S, T],
    ``normed`` [S, T, d], ``feats``, ``lengths`` / ``loss_from`` [S]); rows: held-out row indices; full_lm [V, d]:
    the target's LM head; row_temperatures [S] float (NaN: unknown): the temperature each row's response was
    sampled at. Per setting (greedy, each of ``temperatures``, each ``filtered`` {key: SamplingParams}):
      * tau {gamma: tau} for gamma = 1..steps: the chain walked along the rows sampled at that setting
        (training.chain_walk, exact in law for live decoding of such prompts); where those rows hold fewer than
        ``min_positions`` response tokens (or none are known), along all rows with each position's expected
        acceptance sum_v min(p, q) (the data's contexts: an approximation);
      * alpha [a_1..a_steps]: the per-depth acceptance whose chain formula gives that tau (chain_walk.alphas_of_taus);
      * teacher-forced alpha: sum_v min(p, q) averaged over all response positions (given the data's tokens).
    -> {"alpha_per_step", "tau" (greedy), "positions", "chain_rows" {key: rows walked, 0 = all rows, approximate},
    "teacher_forced" {"alpha_by_setting", "tau_by_setting"}}; with ``temperatures`` also "alpha_by_temperature" /
    "tau_by_temperature" {"0.7": ..}; with ``filtered`` "alpha_by_sampling" / "tau_by_sampling". Positions are
    processed ``chunk`` at a time (the target's [chunk, V] rows are the largest tensors).
    """
    from .chain_walk import alphas_of_taus, taus_of_walks

    settings = {_temperature_key(0.0): SamplingParams(temperature=0.0)}
    settings.update({_temperature_key(t): SamplingParams(temperature=float(t)) for t in temperatures})
    settings.update(filtered or {})
    total = {key: [0.0] * steps for key in settings}
    count = [0.0] * steps
    t_len = data["tokens"].shape[1]
    walk = {key: torch.zeros((len(rows), steps, t_len)) for key in settings}      # exact: min(1, q(x) / p(x))
    mean = {key: torch.zeros((len(rows), steps, t_len)) for key in settings}      # sum_v min(p, q)
    was_training = head.training
    head.eval()
    for i in range(0, len(rows), batch):
        idx = rows[i:i + batch]
        toks, normed = data["tokens"][idx], data["normed"][idx]
        pos = torch.arange(toks.shape[1], device=toks.device)[None]
        nxt = torch.cat([toks[:, 1:], toks[:, -1:]], dim=1)
        with autocast_for(toks.device):
            outs = head.ttt_forward(head.fuse(data["feats"][idx]), nxt, steps)
        teach_h = torch.cat([normed[:, 1:], normed[:, -1:]], dim=1)
        base = (pos + 2 < data["lengths"][idx, None]) & (pos + 2 >= data["loss_from"][idx, None])
        for k, h in enumerate(outs, start=1):
            r, c = (base & (pos >= k - 1)).nonzero(as_tuple=True)
            count[k - 1] += float(r.numel())
            for j in range(0, r.numel(), chunk):
                rj, cj = r[j:j + chunk], c[j:j + chunk]
                small = head.logits(h[rj, cj].to(head.fc.weight.dtype))
                full = F.linear(teach_h[rj, cj].to(full_lm.dtype), full_lm)
                out_r, out_c = (rj + i).cpu(), (cj + 2).cpu()      # entry e drafts token e + 2
                for key, sampling in settings.items():
                    a = acceptance(full, small, head.vocab_ids, sampling)
                    total[key][k - 1] += float(a.sum())
                    mean[key][out_r, k - 1, out_c] = a.cpu()
                    walk[key][out_r, k - 1, out_c] = emitted_acceptance(
                        full, small, toks[rj, cj + 2], head.vocab_ids, sampling).cpu()
    head.train(was_training)
    teacher = {key: [round(a / max(n, 1.0), 4) for a, n in zip(vals, count)] for key, vals in total.items()}
    start = data["loss_from"][rows].cpu()     # the engine's first step drafts the first response token too
    end = data["lengths"][rows].cpu()
    alpha, tau, chain_rows = {}, {}, {}
    temps_here = row_temperatures.cpu().float()[rows.cpu()] if row_temperatures is not None else None
    for key, sampling in settings.items():
        sel = _sampled_at(sampling, temps_here, (end - start).clamp(min=0), min_positions)
        acc, s_idx = (walk[key], sel.nonzero()[:, 0]) if sel is not None else (mean[key], torch.arange(len(rows)))
        taus = taus_of_walks(acc[s_idx], start[s_idx], end[s_idx], range(1, steps + 1))
        tau[key] = {g: round(v, 3) for g, v in taus.items()}
        alpha[key] = [round(a, 4) for a in alphas_of_taus(taus)]
        chain_rows[key] = int(s_idx.numel()) if sel is not None else 0
    greedy = _temperature_key(0.0)
    out = {"alpha_per_step": alpha[greedy], "tau": tau[greedy], "positions": int(count[0]), "chain_rows": chain_rows,
           "teacher_forced": {"alpha_by_setting": teacher,
                              "tau_by_setting": {key: tau_by_gamma(a) for key, a in teacher.items()}}}
    temps = [_temperature_key(t) for t in temperatures]
    if temps:
        out["alpha_by_temperature"] = {key: alpha[key] for key in temps}
        out["tau_by_temperature"] = {key: tau[key] for key in temps}
    if filtered:
        out["alpha_by_sampling"] = {key: alpha[key] for key in filtered}
        out["tau_by_sampling"] = {key: tau[key] for key in filtered}
    return out


def autocast_for(device):
    """bf16 autocast on CUDA (how the head trains there); none on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
