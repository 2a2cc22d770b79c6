"""Goodness-of-fit statistics for the exactness suite: G-test and Pearson chi-square against an exact law.

Categories whose expected count is below ``min_expected`` are pooled into one bin (the usual validity rule);
a sample that lands in a category of exact probability 0 fails the test outright (p-value 0), whatever its count.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import stats as sps


@dataclass
class FitResult:
    """One goodness-of-fit test of observed counts against exact probabilities."""

    statistic: float          # G statistic (2 * sum O log(O/E))
    chi2: float               # Pearson chi-square on the same bins
    dof: int
    p_value: float            # of the G-test
    chi2_p_value: float
    tv_distance: float        # total variation between the empirical and exact laws (unpooled)
    impossible: int           # samples that fell in categories of exact probability 0
    bins: int


def fit_test(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> FitResult:
    """Compare counts [C] with exact probabilities [C] (summing to 1). Returns G and chi-square p-values."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    if observed.shape != probs.shape:
        raise ValueError(f"observed {observed.shape} and expected {probs.shape} differ in shape")
    n = observed.sum()
    if n <= 0:
        raise ValueError("no samples to test")
    probs = np.clip(probs, 0.0, None)
    probs = probs / probs.sum()
    impossible = int(observed[probs <= 0].sum())
    tv = 0.5 * float(np.abs(observed / n - probs).sum())
    expected = probs * n
    big = expected >= min_expected
    obs_bins = list(observed[big])
    exp_bins = list(expected[big])
    small_exp = expected[~big & (probs > 0)].sum()
    small_obs = observed[~big & (probs > 0)].sum()
    if small_exp > 0:
        obs_bins.append(small_obs)
        exp_bins.append(small_exp)
    o, e = np.array(obs_bins), np.array(exp_bins)
    if len(o) <= 1:
        g = chi2 = 0.0
        dof = 0
        p = cp = 1.0
    else:
        with np.errstate(divide="ignore", invalid="ignore"):
            g = float(2.0 * np.sum(np.where(o > 0, o * np.log(o / e), 0.0)))
        chi2 = float(np.sum((o - e) ** 2 / e))
        dof = len(o) - 1
        p = float(sps.chi2.sf(g, dof))
        cp = float(sps.chi2.sf(chi2, dof))
    if impossible:
        p = cp = 0.0
    return FitResult(statistic=g, chi2=chi2, dof=dof, p_value=p, chi2_p_value=cp, tv_distance=tv,
                     impossible=impossible, bins=len(o))


@dataclass
class CaseResult:
    """Outcome of one exactness case for one method (what the CLI prints and writes as JSON)."""

    case: str
    method: str
    samples: int
    alpha: float
    passed: bool
    exact_method: bool = True
    tests: dict = field(default_factory=dict)     # test name -> FitResult as dict
    min_p_value: float = 1.0
    max_tv: float = 0.0
    seconds: float = 0.0
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(case: str, method: str, samples: int, alpha: float, fits: dict[str, FitResult],
              seconds: float, exact_method: bool = True, note: str = "") -> CaseResult:
    """Fold several FitResults into a CaseResult: it passes when every G- and chi-square p-value is >= alpha."""
    min_p = min((min(f.p_value, f.chi2_p_value) for f in fits.values()), default=1.0)
    max_tv = max((f.tv_distance for f in fits.values()), default=0.0)
    return CaseResult(case=case, method=method, samples=samples, alpha=alpha, passed=min_p >= alpha,
                      exact_method=exact_method, tests={k: asdict(v) for k, v in fits.items()},
                      min_p_value=min_p, max_tv=max_tv, seconds=seconds, note=note)
