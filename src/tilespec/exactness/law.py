"""The exact output law of one speculative-sampling step, for small vocabularies (float64, by enumeration).

Setting: one request with K_b draft positions; at position j the draft token x_j is drawn from q_j (independently
across positions, as the suite draws them) and the target distribution is p_j. A method accepts x_j with
probability acc_j(x_j) and, at the first rejection, emits a token from the residual r_j; if all K_b are accepted it
emits a bonus token from p_{K_b}. Then, with beta_j = sum_x q_j(x) acc_j(x):

    P(N = n, y_0..y_n) = prod_{i<n} q_i(y_i) acc_i(y_i) * ( (1 - beta_n) r_n(y_n)  if n < K_b  else  p_{K_b}(y_n) )

For exact sampling acc = min(1, p/q) and r = norm((p - q)+), so q acc = min(p, q), (1 - beta) r = (p - q)+ and the
token emitted at every reached position is distributed as p_j. With lenience l: acc = min(1, p / (l q)) and
r = norm((p - l q)+) (this module derives the law the `lenience` option must follow). Greedy rows (temperature 0)
accept iff x is the target argmax (or, lenient, iff p1(x) >= l max p1) and otherwise emit the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..verify.distributions import draft_log_probs, lenient_greedy_logprobs, log_probs
from ..verify.types import ResolvedSampling


@dataclass
class StepLaw:
    """Exact per-position quantities of one request (float64 numpy).

    p: [K_b+1, V] target law per position. accept_mass: [K_b, V] = q(x) acc(x) (probability to draft x and accept it).
    reject_emit: [K_b, V] = (1 - beta) r (probability to reject at j and emit y). beta: [K_b].
    """

    p: np.ndarray
    accept_mass: np.ndarray
    reject_emit: np.ndarray
    beta: np.ndarray

    @property
    def num_draft(self) -> int:
        return self.accept_mass.shape[0]

    @property
    def vocab(self) -> int:
        return self.p.shape[1]

    def reach(self) -> np.ndarray:
        """[K_b+1] probability that position j is reached (all earlier drafts accepted)."""
        return np.concatenate([[1.0], np.cumprod(self.beta)])

    def final_law(self) -> np.ndarray:
        """[(K_b+1) * V] law of (N, last emitted token y_N), flattened as n * V + y."""
        reach = self.reach()
        rows = [reach[n] * self.reject_emit[n] for n in range(self.num_draft)]
        rows.append(reach[-1] * self.p[-1])
        return np.concatenate(rows)

    def position_law(self, j: int) -> np.ndarray:
        """Law at position j: [accepted x (V) | rejected, emitted y (V) | not reached (1)] (bonus: [y (V) | not])."""
        reach = self.reach()[j]
        if j == self.num_draft:
            return np.concatenate([reach * self.p[j], [1.0 - reach]])
        return np.concatenate([reach * self.accept_mass[j], reach * self.reject_emit[j], [1.0 - reach]])

    def sequence_law(self, min_prob: float) -> dict[tuple, float]:
        """Probabilities of every emitted sequence (y_0..y_N) with probability >= min_prob (depth-first, pruned)."""
        out: dict[tuple, float] = {}

        def walk(prefix: tuple, prob: float, j: int) -> None:
            if j == self.num_draft:
                for y in np.nonzero(self.p[j] * prob >= min_prob)[0]:
                    out[prefix + (int(y),)] = prob * self.p[j, y]
                return
            for y in np.nonzero(self.reject_emit[j] * prob >= min_prob)[0]:
                out[prefix + (int(y),)] = out.get(prefix + (int(y),), 0.0) + prob * self.reject_emit[j, y]
            for x in np.nonzero(self.accept_mass[j] * prob >= min_prob)[0]:
                walk(prefix + (int(x),), prob * self.accept_mass[j, x], j + 1)

        walk((), 1.0, 0)
        return out


def step_law(target_logits: torch.Tensor, draft_logits: torch.Tensor | None, draft_probs: torch.Tensor | None,
             draft_tokens: torch.Tensor, num_draft: int, sampling: ResolvedSampling) -> StepLaw:
    """Exact law for one request. target_logits [1, K+1, V], drafts [1, K, V] or None, draft_tokens [1, K] (used
    only for one-hot drafts), sampling resolved for a batch of 1. Positions past num_draft are ignored."""
    vocab = target_logits.shape[-1]
    p = log_probs(target_logits, sampling).double().exp()[0, :num_draft + 1].numpy()
    p = p / p.sum(-1, keepdims=True)   # fp32 log-probs are normalised only to ~1e-7; Gumbel-max needs no norm
    q = draft_log_probs(draft_tokens, vocab, sampling, draft_logits, draft_probs).double().exp()[0, :num_draft]
    q = q.numpy()
    q = q / q.sum(-1, keepdims=True) if q.size else q
    lenience = float(sampling.lenience[0])
    greedy = float(sampling.temperature[0]) == 0.0
    accept_mass = np.zeros((num_draft, vocab))
    reject_emit = np.zeros((num_draft, vocab))
    beta = np.zeros(num_draft)
    if greedy and lenience < 1:
        p1 = lenient_greedy_logprobs(target_logits, sampling).double().exp()[0].numpy()
    for j in range(num_draft):
        if greedy:
            argmax = int(np.argmax(p[j]))
            acc = np.zeros(vocab)
            if lenience < 1:
                acc[p1[j] >= lenience * p1[j].max()] = 1.0
            else:
                acc[argmax] = 1.0
            residual = np.zeros(vocab)
            residual[argmax] = 1.0
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                acc = np.where(q[j] > 0, np.minimum(1.0, p[j] / (lenience * q[j])), 0.0)
            residual = np.clip(p[j] - lenience * q[j], 0.0, None)
            residual = residual / residual.sum() if residual.sum() > 0 else p[j]
        accept_mass[j] = q[j] * acc
        beta[j] = accept_mass[j].sum()
        reject_emit[j] = (1.0 - beta[j]) * residual
    return StepLaw(p=p, accept_mass=accept_mass, reject_emit=reject_emit, beta=beta)
