"""The exactness suite itself: exact laws are laws, exact methods pass, a planted bias is caught.

Every case runs at SAMPLES draws, the size at which the planted 1 % bias is still caught (test_planted_bias_is_caught);
the 10^6-sample tier is marked ``slow`` (not in the default run; the GPU runbook runs it with ``-m slow`` and
``tilespec check exactness``)."""
import numpy as np
import pytest
import torch

from tilespec.exactness.cases import default_cases
from tilespec.exactness.law import step_law
from tilespec.exactness.stats import fit_test
from tilespec.exactness.suite import biased_reference, check_determinism, method_sampler, run_case, run_suite
from tilespec.verify.validation import resolve_sampling
from tiers import fast_first

SAMPLES = 40_000   # the planted 1 % bias is caught in all three power cases from ~30,000 draws (not at 20,000)


def _law(case, k_b):
    tl = case.target_logits[None].float()
    dl = case.draft_logits[None] if case.draft_logits is not None else None
    dp = case.draft_probs[None] if case.draft_probs is not None else None
    fixed = (case.draft_tokens if case.draft_tokens is not None else torch.zeros(case.max_draft, dtype=torch.long))
    return step_law(tl, dl, dp, fixed[None], k_b, resolve_sampling(case.sampling, 1, "cpu"))


@pytest.mark.parametrize("case", default_cases(), ids=lambda c: c.name)
def test_exact_laws_are_distributions(case):
    for k_b in case.lengths:
        law = _law(case, k_b)
        assert law.final_law().sum() == pytest.approx(1.0, abs=1e-9)
        for j in range(k_b + 1):
            pos = law.position_law(j)
            assert pos.min() >= 0 and pos.sum() == pytest.approx(1.0, abs=1e-9)
        seqs = law.sequence_law(min_prob=0.0 if case.target_logits.shape[-1] ** (k_b + 1) < 5e4 else 1e-6)
        assert sum(seqs.values()) <= 1.0 + 1e-9


def test_emitted_token_at_each_reached_position_follows_target():
    """Without lenience, y_j given N >= j is distributed as p_j: accepted mass + rejected mass = reach * p_j."""
    case = default_cases()[0]
    law = _law(case, case.max_draft)
    reach = law.reach()
    for j in range(case.max_draft):
        np.testing.assert_allclose(law.accept_mass[j] + law.reject_emit[j], law.p[j], atol=1e-12)
        assert reach[j + 1] == pytest.approx(reach[j] * law.beta[j])


def test_fit_test_flags_impossible_samples_and_accepts_exact_counts():
    probs = np.array([0.5, 0.5, 0.0])
    assert fit_test(np.array([500, 500, 1]), probs).p_value == 0.0
    assert fit_test(np.array([5000, 5000, 0]), probs).p_value > 0.5
    with pytest.raises(ValueError):
        fit_test(np.array([1, 2]), probs)


@pytest.mark.parametrize("method", fast_first(["reference", "coupled", "hf"], 2))
def test_exact_methods_pass_every_case(method):
    results = run_suite([method], samples=SAMPLES, power_check=False)
    failed = [(r.case, r.min_p_value) for r in results if not r.passed]
    assert not failed, failed
    assert len(results) >= 16


@pytest.mark.slow
@pytest.mark.parametrize("name", ["generic K=5 V=16", "ragged K_b in {0, 2, 5}", "lenience 0.5", "bf16 logits"])
def test_reference_passes_with_a_million_samples(name):
    case = next(c for c in default_cases() if c.name == name)
    result = run_case(case, method_sampler("reference"), "reference", samples=1_000_000, chunk=100_000)
    assert result.passed, (result.min_p_value, result.tests)


def test_planted_bias_is_caught():
    results = run_suite([], samples=SAMPLES, power_check=True)
    assert len(results) == 3
    assert all(r.passed for r in results), [(r.case, r.min_p_value) for r in results]


def test_biased_sampler_moves_about_one_percent():
    case = default_cases()[1]
    r = run_case(case, biased_reference, "biased", samples=100_000)
    assert not r.passed
    assert 0.005 < r.max_tv < 0.03


def test_reference_is_deterministic_under_batch_changes():
    assert check_determinism("reference").passed


@pytest.mark.parametrize("method", ["fused", "tiled"])
def test_triton_kernels_pass_selected_cases_in_the_interpreter(method):
    """The Triton kernels themselves (CPU interpreter, batched small-vocabulary layout) against the exact law.
    The full suite: bench/results/exactness-cpu-fused-reference-tiled-coupled.json and exactness-cpu-tiled.json (10^6)."""
    names = ("generic K=5 V=16", "ragged K_b in {0, 2, 5}", "temperature 0 vs close draft", "lenience 0.5",
             "top-p 0.8 temperature 0.7")
    for case in (c for c in default_cases() if c.name in names):
        result = run_case(case, method_sampler(method), method, samples=SAMPLES)
        assert result.passed, (case.name, result.min_p_value)
    assert check_determinism(method).passed
