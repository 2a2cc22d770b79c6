"""Measurement helpers of the multi-draft study (``python -m bench.multidraft``; paper settings: Fig. 3, Fig. 4,
Tables 1-3).

* Token-level acceptance (Table 3): at a context on a target-generated trajectory, with target law p and draft
  law q (temperature / top-p applied), the exact acceptance of Optimal (alpha*_K, sorted scan), IS (truncated
  LP, chain), SpecTr and SpecInfer for K i.i.d. drafts. No sampling involved.
* Block efficiency (Figs. 3/4, Tables 1/2): one drafted round (a :class:`tilespec.multidraft.decoding.Round` with
  several draft groups) is verified by every configuration R times with independent keyed randomness; the mean number of
  emitted tokens per target call is recorded. All configurations see the same drafts (paired comparison).
  Distributions are restricted to the union of their supports first (exact: tokens outside have probability 0
  under every law of the round).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tilespec.multidraft.chain import sampling_probs, verify_multidraft
from tilespec.multidraft.optimum import optimal_acceptance
from tilespec.multidraft.schemes import accept_probability
from tilespec.verify.types import SamplingParams

TABLE3_SCHEMES = ("optimal", "is", "spectr", "specinfer")


def support_union(*laws: torch.Tensor) -> torch.Tensor:
    """Sorted token ids [V'] where any of the laws [..., V] is positive."""
    mask = torch.zeros(laws[0].shape[-1], dtype=torch.bool, device=laws[0].device)
    for law in laws:
        mask |= (law.reshape(-1, law.shape[-1]) > 0).any(0)
    return mask.nonzero().squeeze(1)


def token_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, sampling: SamplingParams,
                     draft_temps, ks=(2, 4, 8), s: int = 5, m: int | None = 40,
                     extra_is=("is-s5", "is-s15-m40")) -> dict:
    """Exact per-position acceptance. target_logits, draft_logits [N, V] raw logits at N trajectory positions.

    Returns {T_d: {K: {scheme: [N] list}}} for schemes Optimal / IS (s, m; key 'is') / SpecTr / SpecInfer and the
    IS variants named in ``extra_is`` (truncation study); the draft uses ``sampling`` with temperature T_d.
    """
    p = sampling_probs(target_logits[None], sampling)[0]
    out = {}
    for temp in draft_temps:
        ds = SamplingParams(temperature=temp, top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p)
        q = sampling_probs(draft_logits[None], ds)[0]
        res = {}
        for k in ks:
            vals = {name: [] for name in ("optimal", "is", "spectr", "specinfer") + tuple(extra_is)}
            for i in range(p.shape[0]):
                idx = support_union(p[i], q[i])
                pi, qi = p[i, idx][None], q[i, idx][None]
                qk = qi[:, None].expand(1, k, -1)
                vals["optimal"].append(float(optimal_acceptance(pi, qi, k)[0]))
                name = "is" if m is None else f"is-s{s}-m{m}"
                vals["is"].append(float(accept_probability(name, pi, qk)[0]))
                vals["spectr"].append(float(accept_probability("spectr", pi, qk)[0]))
                vals["specinfer"].append(float(accept_probability("specinfer", pi, qk)[0]))
                for variant in extra_is:
                    vals[variant].append(float(accept_probability(variant, pi, qk)[0]))
            res[k] = vals
        out[temp] = res
    return out


@dataclass(frozen=True)
class Config:
    """One block-efficiency configuration: a scheme applied to some draft rows (indices into the round's K)."""

    setting: str
    label: str
    scheme: str
    rows: tuple


def paper_configs(groups: dict, fig3_temps, table1_ks, fig4_temps, table2_temp) -> list[Config]:
    """Configurations of Fig. 3 (K = 2 i.i.d. drafts per temperature; IS/SpecTr/SpecInfer/SD), Table 1
    (T = 1.2, K = 2..), Fig. 4 (draft 1 at 1.2, draft 2 at T; IS/SpecInfer) and Table 2 (truncation at the
    Fig. 4 setting with draft 2 at ``table2_temp``). ``groups`` maps a temperature to its row indices."""
    cfg = []
    for temp in fig3_temps:
        rows = tuple(groups[temp][:2])
        for scheme in ("sd", "specinfer", "spectr", "is"):
            cfg.append(Config("fig3", f"T={temp}", scheme, rows[:1] if scheme == "sd" else rows))
    base = groups[1.2]
    for k in table1_ks:
        for scheme in ("specinfer", "spectr", "is"):
            cfg.append(Config("table1", f"K={k}", scheme, tuple(base[:k])))
    for temp in fig4_temps:
        second = base[1] if temp == 1.2 else groups[temp][0]
        for scheme in ("specinfer", "is"):
            cfg.append(Config("fig4", f"T2={temp}", scheme, (base[0], second)))
    second = groups[table2_temp][0]
    for scheme in ("is-s5-m10", "is-s5-m20", "is-s5-m40", "is-s5-m50", "is-s5", "is-s10", "is-s15"):
        cfg.append(Config("table2", f"T2={table2_temp}", scheme, (base[0], second)))
    return cfg


def round_block_efficiency(rnd, configs: list[Config], sampling: SamplingParams, reps: int, seed: int) -> dict:
    """Mean tokens per target call of each configuration on one drafted round (B = 1 request)."""
    p_full = sampling_probs(rnd.target_logits[0], sampling)                      # [K, L+1, V] float64
    q_full = rnd.draft_probs[0]
    out, cache = {}, {}
    for c in configs:
        rows = list(c.rows)
        if c.rows not in cache:                                                 # per row set: smaller support
            idx = support_union(p_full[rows], q_full[rows])
            remap = torch.full((p_full.shape[-1],), -1, dtype=torch.int64)
            remap[idx] = torch.arange(idx.numel())
            cache[c.rows] = (p_full[rows][:, :, idx], q_full[rows][:, :, idx], remap[rnd.draft_tokens[0][rows]], idx)
        p, q, toks, idx = cache[c.rows]
        kk, ll, vv = len(rows), q.shape[1], q.shape[2]
        res = verify_multidraft(None, toks[None].expand(reps, kk, ll),
                                target_probs=p[None].expand(reps, kk, ll + 1, vv),
                                draft_probs=q[None].expand(reps, kk, ll, vv), scheme=c.scheme,
                                seed=seed * 1000 + torch.arange(reps) * 7919, sampler="cdf", check_values=False)
        out[c] = (float(res.num_emitted.double().mean()), res, idx)
    return out
