"""How often a draft head's tokens would be accepted, at a sampling temperature: the held-out estimate of head training.

Exact speculative sampling accepts a draft token drawn from q with probability sum_v min(p(v), q(v)) = 1 - TV(p, q)
(Leviathan et al. 2023), p and q the target's and the draft's distributions after the same temperature and
filters. For a head with a reduced draft vocabulary (target ids ``vocab_ids``), q is zero outside it, so the sum
runs over the draft vocabulary with p the target's FULL-vocabulary probabilities there (the mass p puts outside
is never accepted). At temperature 0 both are one-hot at their (first) argmax: acceptance is argmax agreement.

:func:`held_out` runs the head's training-time test on held-out rows and averages that per draft depth k over
response positions: alpha_k(T) is the acceptance of the k-th drafted token given the first k - 1 accepted, with the
context being the data's own tokens (responses the target sampled; at T > 0 an accepted draft token is distributed
as min(p, q) / alpha rather than as p, which this estimate ignores). tau(gamma) = 1 + a_1 + a_1 a_2 + ... + a_1..a_gamma
is then the expected tokens per target forward of a chain of gamma draft tokens.
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


def _temperature_key(t: float) -> str:
    return f"{t:g}"


@torch.no_grad()
def held_out(head, data: dict, rows: torch.Tensor, steps: int, full_lm: torch.Tensor, batch: int = 8,
             temperatures: tuple = (), filtered: Optional[dict] = None, chunk: int = 1024) -> dict:
    """The head's held-out acceptance per draft depth (see the module docstring).

    head: a DraftHead bound to the target; data: ``head_data.sequence_features`` output (``tokens`` [S, T],
    ``normed`` [S, T, d], ``feats``, ``lengths`` / ``loss_from`` [S]); rows: held-out row indices; full_lm [V, d]:
    the target's LM head. Always -> {"alpha_per_step": [a_1..a_steps] greedy, "tau": {gamma: tau}, "positions"};
    with ``temperatures`` also "alpha_by_temperature" / "tau_by_temperature" {"0.7": [..] / {gamma: tau}} and with
    ``filtered`` ({key: SamplingParams}) "alpha_by_sampling" / "tau_by_sampling". Positions are processed
    ``chunk`` at a time (the target's [chunk, V] rows are the largest tensors).
    """
    settings = {_temperature_key(0.0): SamplingParams(temperature=0.0)}
    settings.update({_temperature_key(t): SamplingParams(temperature=float(t)) for t in temperatures})
    settings.update(filtered or {})
    total = {key: [0.0] * steps for key in settings}
    count = [0.0] * steps
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
                for key, sampling in settings.items():
                    total[key][k - 1] += float(acceptance(full, small, head.vocab_ids, sampling).sum())
    head.train(was_training)
    alpha = {key: [round(a / max(n, 1.0), 4) for a, n in zip(vals, count)] for key, vals in total.items()}
    greedy = alpha[_temperature_key(0.0)]
    out = {"alpha_per_step": greedy, "tau": tau_by_gamma(greedy), "positions": int(count[0])}
    temps = [_temperature_key(t) for t in temperatures]
    if temps:
        out["alpha_by_temperature"] = {key: alpha[key] for key in temps}
        out["tau_by_temperature"] = {key: tau_by_gamma(alpha[key]) for key in temps}
    if filtered:
        out["alpha_by_sampling"] = {key: alpha[key] for key in filtered}
        out["tau_by_sampling"] = {key: tau_by_gamma(alpha[key]) for key in filtered}
    return out


def autocast_for(device):
    """bf16 autocast on CUDA (how the head trains there); none on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
