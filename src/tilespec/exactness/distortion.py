"""Distortion of a NON-EXACT verification method (the paper's ``sigmoid``): how far its output law is from the target's.

For K = 1 the law of the first emitted token is computable in closed form (float64): with surrogate weights p_hat,
q_hat and the draft token x ~ q,
    P(emit y) = q(y) a(y) + (1 - sum_x q(x) a(x)) r(y),   a = min(1, p_hat / q_hat),  r = norm(max(0, p_hat - q_hat))
(r falls back to norm(p_hat) when the residual is zero), while an exact method emits exactly p. Reported per
(alpha, beta) in {+-10, +-1e3, +-1e4, +-1e5} and per logit shape: the TV distance of that law from p, the TV of the
bonus-row law norm(p_hat) from p, and the acceptance rate against the exact one, sum_x min(p, q) (its inflation).
One configuration is also sampled through the kernel itself (``samples`` requests, capped on CPU where Triton runs
interpreted) to confirm the closed form describes what the kernel does. Nothing here ever fails a run.
"""
from __future__ import annotations

import math

import torch

CONSTANTS = (10.0, 1e3, 1e4, 1e5)
CPU_SAMPLE_CAP = 400


def logit_shapes(seed: int, vocab: int = 32000) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(target, draft) logit rows [V] (float32) of LM-like shapes: Zipf-ranked logits with noise, a top-k 50
    truncation of them (HF's default warper: -inf elsewhere), and a peaked ASR-like row."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    base = 25.0 - 1.1 * 2.5 * torch.log(ranks)                   # ~ logits of a 7B LM: max ~25, long tail
    perm = torch.randperm(vocab, generator=gen)
    target = (base + torch.randn(vocab, generator=gen, dtype=torch.float64))[perm]
    draft = target + 1.5 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    k50 = target.topk(50).values[-1]
    top_t = torch.where(target >= k50, target, torch.tensor(-math.inf, dtype=torch.float64))
    top_d = torch.where(draft >= draft.topk(50).values[-1], draft, torch.tensor(-math.inf, dtype=torch.float64))
    peaked_t = target.clone()
    peaked_t[perm[0]] += 12.0
    peaked_d = peaked_t + 2.0 * torch.randn(vocab, generator=gen, dtype=torch.float64)
    return {f"lm-zipf V={vocab}": (target.float(), draft.float()), "lm-zipf top-k 50": (top_t.float(), top_d.float()),
            f"asr-peaked V={vocab}": (peaked_t.float(), peaked_d.float())}


def sigmoid_hat(z: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """The paper's Eq. 5 surrogate in float64: 0 below alpha, 1 above beta, sigmoid((z - a) / (b - a)) between."""
    z = z.double()
    mid = torch.sigmoid((z - alpha) / (beta - alpha))
    return torch.where(z < alpha, 0.0, torch.where(z > beta, 1.0, mid))


def sigmoid_first_token_law(target: torch.Tensor, draft: torch.Tensor, alpha: float, beta: float):
    """(law of the first emitted token [V], acceptance probability) of the sigmoid method at K = 1 (float64)."""
    q = torch.softmax(draft.double(), -1)
    p_hat, q_hat = sigmoid_hat(target, alpha, beta), sigmoid_hat(draft, alpha, beta)
    a = torch.where(q_hat > 0, torch.clamp(p_hat / q_hat.clamp(min=1e-300), max=1.0), torch.zeros_like(p_hat))
    accepted = q * a
    residual = torch.clamp(p_hat - q_hat, min=0.0)
    residual = residual if residual.sum() > 0 else p_hat
    law = accepted + (1 - accepted.sum()) * residual / residual.sum()
    return law, float(accepted.sum())


def _sample_kernel(method: str, target, draft, alpha, beta, samples, seed) -> torch.Tensor:
    """Empirical law of the first emitted token from ``samples`` K = 1 requests through the method's kernel."""
    from ..verify.validation import prepare_inputs
    from ..verify.registry import get_method
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.multinomial(torch.softmax(draft.double(), -1), samples, replacement=True, generator=gen)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = target.view(1, 1, -1).expand(samples, 2, -1).contiguous().to(device)
    t[:, 1] = target
    d = draft.view(1, 1, -1).expand(samples, 1, -1).contiguous().to(device)
    inputs = prepare_inputs(t, tokens.view(-1, 1).to(device), draft_logits=d, seed=seed * 7919, check_values=False)
    options = {"alpha": alpha, "beta": beta} if method == "sigmoid" else None
    result = get_method(method)(inputs, options)
    first = result.output_tokens[:, 0].cpu()
    return torch.bincount(first, minlength=target.numel()).double() / samples


def run_distortion(method: str, samples: int, seed: int) -> list[dict]:
    """Distortion rows for a non-exact method (only ``sigmoid`` is known); never raises for a bad distortion."""
    if method != "sigmoid":
        return [{"method": method, "exact": False, "note": "no distortion model for this method; not measured"}]
    rows = []
    shapes = logit_shapes(seed)
    for shape, (target, draft) in shapes.items():
        p = torch.softmax(target.double(), -1)
        exact_accept = float(torch.minimum(p, torch.softmax(draft.double(), -1)).sum())
        for c in CONSTANTS:
            law, acc = sigmoid_first_token_law(target, draft, -c, c)
            bonus = sigmoid_hat(target, -c, c)
            rows.append({"method": method, "exact": False, "shape": shape, "alpha": -c, "beta": c,
                         "tv_first_token": round(0.5 * float((law - p).abs().sum()), 4),
                         "tv_bonus_token": round(0.5 * float((bonus / bonus.sum() - p).abs().sum()), 4),
                         "accept_exact": round(exact_accept, 4), "accept_sigmoid": round(acc, 4),
                         "acceptance_inflation": round(acc / exact_accept, 3) if exact_accept > 0 else None,
                         "passed": True})
    # confirm the closed form against the kernel on one configuration (the paper's text setting)
    on_gpu = torch.cuda.is_available()
    n = samples if on_gpu else min(samples, CPU_SAMPLE_CAP)
    target, draft = (shapes if on_gpu else logit_shapes(seed, vocab=2048))["lm-zipf top-k 50"]
    if n > 0:
        law, _ = sigmoid_first_token_law(target, draft, -1e4, 1e4)
        empirical = _sample_kernel(method, target, draft, -1e4, 1e4, n, seed)
        rows.append({"method": method, "exact": False, "shape": f"lm-zipf top-k 50 V={target.numel()}",
                     "alpha": -1e4, "beta": 1e4,
                     "kernel_samples": n, "tv_kernel_vs_closed_form": round(0.5 * float((empirical - law).abs().sum()),
                                                                             4),
                     "note": "sampling noise only if the closed form matches the kernel", "passed": True})
    return rows
