"""Multi-draft selection schemes: exactness, the optimum (closed forms vs LP), paper examples, bad input."""
import numpy as np
import pytest
import torch

from tilespec.multidraft import (Stream, lp_optimum, optimal_acceptance, optimal_acceptance_brute, parse_scheme,
                                 select, accept_probability, theorem3_acceptance, verify_multidraft)
from tilespec.multidraft.exactness import chain_case, run_multidraft_exactness
from tilespec.multidraft.importance import plan_pair
from tilespec.multidraft.optimum import acceptance_gap
from tilespec.verify.api import verify

D = torch.float64


def t(x):
    return torch.tensor([x], dtype=D)


def rand_law(rng, v, zeros=0.0):
    x = rng.dirichlet(np.ones(v) * rng.choice([0.3, 1.0, 3.0]))
    if zeros:
        x = np.where(rng.random(v) < zeros, 0.0, x)
        if x.sum() == 0:
            x[0] = 1.0
    return x / x.sum()


# ---------------------------------------------------------------- exactness (the suite the CLI runs)
def test_exactness_suite_all_schemes_pass_and_planted_bias_fails():
    results = run_multidraft_exactness(samples=12000, alpha=1e-6, seed=1)
    methods = {r.method for r in results}
    for name in ("sd", "specinfer", "spectr", "is", "is-lp", "is-s2", "is-m3"):
        assert f"multidraft:{name}" in methods
    for r in results:
        if r.exact_method:
            assert r.passed, (r.case, r.method, r.min_p_value)
        else:
            assert not r.passed and "power check" in r.note


def test_chain_noniid_specinfer_exact():
    r = chain_case("specinfer", (1.0, 2.4), 4000, 1e-6, seed=3)
    assert r.passed, r.min_p_value


# ---------------------------------------------------------------- the optimum
def test_worked_example_1():
    p, q = t([0.4, 0.3, 0.2, 0.1]), t([0.1, 0.2, 0.3, 0.4])
    expect = {1: 0.6, 2: 0.79, 3: 0.871, 4: 0.9439}
    for k, val in expect.items():
        assert optimal_acceptance(p, q, k).item() == pytest.approx(val, abs=1e-12)
    qs = q[:, None].expand(1, 2, 4)
    assert accept_probability("specinfer", p, qs).item() == pytest.approx(0.72, abs=1e-12)
    assert accept_probability("spectr", p, qs).item() == pytest.approx(0.75, abs=1e-9)
    assert accept_probability("is-s0", p, qs).item() == pytest.approx(0.79, abs=1e-12)


def test_worked_example_2_truncation():
    p, q = t([0.04, 0.52, 0.23, 0.21]), t([0.36, 0.35, 0.10, 0.19])
    qs = q[:, None].expand(1, 2, 4)
    assert optimal_acceptance(p, q, 2).item() == pytest.approx(0.9104, abs=1e-12)
    assert accept_probability("is-s0", p, qs).item() == pytest.approx(0.8529, abs=1e-12)
    assert accept_probability("is-s2", p, qs).item() == pytest.approx(0.9104, abs=1e-9)
    assert accept_probability("sd", p, qs).item() == pytest.approx(0.68, abs=1e-12)


def test_lp_optimum_equals_closed_forms_random():
    rng = np.random.default_rng(0)
    for case in range(14):
        v = int(rng.integers(2, 5))
        k = 2 if case % 2 else 3
        p = rand_law(rng, v, zeros=0.2)
        q = rand_law(rng, v, zeros=0.2)
        lp = lp_optimum(p, np.stack([q] * k))
        assert optimal_acceptance(torch.tensor(p[None]), torch.tensor(q[None]), k).item() == pytest.approx(lp, abs=1e-7)
        assert optimal_acceptance_brute(p, np.stack([q] * k)) == pytest.approx(lp, abs=1e-7)
        if k == 2:
            assert theorem3_acceptance(p, q) == pytest.approx(lp, abs=1e-7)
            full = accept_probability("is-lp", torch.tensor(p[None]), torch.tensor(np.stack([q, q])[None]))
            assert full.item() == pytest.approx(lp, abs=1e-7)      # exact pair LP attains alpha*
        qs2 = np.stack([rand_law(rng, v) for _ in range(2)])       # non-identical
        assert optimal_acceptance_brute(p, qs2) == pytest.approx(lp_optimum(p, qs2), abs=1e-7)
        full = accept_probability("is-lp", torch.tensor(p[None]), torch.tensor(qs2)[None])
        assert full.item() == pytest.approx(lp_optimum(p, qs2), abs=1e-7)


def test_sorted_scan_equals_brute_force():
    rng = np.random.default_rng(5)
    ps = np.stack([rand_law(rng, 9, zeros=0.3) for _ in range(200)])
    qs = np.stack([rand_law(rng, 9, zeros=0.3) for _ in range(200)])
    for k in (1, 2, 5, 8):
        fast = optimal_acceptance(torch.tensor(ps), torch.tensor(qs), k).numpy()
        slow = np.array([optimal_acceptance_brute(ps[i], np.stack([qs[i]] * k)) for i in range(200)])
        assert np.abs(fast - slow).max() < 1e-12


def test_example1_interval():
    """Paper Example 1: p = (1/2, 1/2), K = 2: alpha* = 1 iff q_0 in [1 - 1/sqrt2, 1/sqrt2]."""
    grid = np.linspace(0, 1, 2001)
    p = torch.tensor([[0.5, 0.5]], dtype=D).expand(len(grid), 2)
    q = torch.tensor(np.stack([grid, 1 - grid], 1))
    ones = grid[(optimal_acceptance(p, q, 2).numpy() > 1 - 1e-12)]
    assert ones.min() == pytest.approx(1 - 1 / np.sqrt(2), abs=1e-3)
    assert ones.max() == pytest.approx(1 / np.sqrt(2), abs=1e-3)


def test_figure2_curves():
    """Paper Figure 2 (n = 3, p uniform, K = 2), left panel q = (1/3, q1, 2/3 - q1); right q = (1/6, q1, 5/6 - q1)."""
    q1 = np.array([0, 1 / 15, 2 / 15, 3 / 15, 4 / 15, 5 / 15])
    left = {"optimal": [.667, .796, .916, 1, 1, 1], "spectr": [.667, .766, .851, .922, .975, 1],
            "specinfer": [.667, .751, .827, .893, .951, 1]}
    p = torch.full((6, 3), 1 / 3, dtype=D)
    q = torch.tensor(np.stack([np.full(6, 1 / 3), q1, 2 / 3 - q1], 1))
    qs = q[:, None].expand(6, 2, 3)
    got = {"optimal": optimal_acceptance(p, q, 2), "spectr": accept_probability("spectr", p, qs),
           "specinfer": accept_probability("specinfer", p, qs)}
    for name, vals in left.items():
        assert np.allclose(got[name].numpy(), vals, atol=1.5e-3), name
    assert np.allclose(accept_probability("is-lp", p, qs).numpy(), left["optimal"], atol=1.5e-3)
    # right panel on the spec's 11-point grid q1 = 0, 1/12, ..., 5/6 (its "peaks" 0.889 / 0.861 are grid maxima;
    # the continuous SpecInfer maximum is higher, e.g. 0.8667 at q1 = 0.3)
    right = {"optimal": [.639, .771, .889, .972, .972, .972], "spectr": [.605, .716, .811, .889, .889, .889],
             "specinfer": [.583, .688, .778, .854, .861, .861]}
    grid = np.linspace(0, 5 / 6, 11)[:6]
    p = torch.full((6, 3), 1 / 3, dtype=D)
    q = torch.tensor(np.stack([np.full(6, 1 / 6), grid, 5 / 6 - grid], 1))
    qs = q[:, None].expand(6, 2, 3)
    got = {"optimal": optimal_acceptance(p, q, 2), "spectr": accept_probability("spectr", p, qs),
           "specinfer": accept_probability("specinfer", p, qs)}
    for name, vals in right.items():
        assert np.allclose(got[name].numpy(), vals, atol=1.5e-3), name
    assert optimal_acceptance(p, q, 2).max().item() == pytest.approx(35 / 36, abs=1e-9)


def test_gap_nonnegative_and_ordering():
    rng = np.random.default_rng(2)
    p = torch.tensor(np.stack([rand_law(rng, 12) for _ in range(40)]))
    q = torch.tensor(np.stack([rand_law(rng, 12) for _ in range(40)]))
    for scheme in ("sd", "specinfer", "spectr", "is"):
        gap = acceptance_gap(scheme, p, q, 3)
        assert bool((gap["gap"] > -1e-9).all()), scheme
    # the exact pairwise LP attains alpha*_2; the truncated one (s = 5 < V) may lose, even below SD (spec 5.4)
    assert float(acceptance_gap("is-lp", p[:10], q[:10], 2)["gap"].abs().max()) < 1e-7


def test_pair_plan_law_is_exact():
    """The computed p_I is the exact law of the selected token (enumerate (X1, X2) and the coin)."""
    rng = np.random.default_rng(7)
    for s in (0, 2, None):
        p, a, b = (torch.tensor(rand_law(rng, 5, zeros=0.2)[None]) for _ in range(3))
        plan = plan_pair(p, a, b, s)
        law = torch.zeros(5, dtype=D)
        for i in range(5):
            for j in range(5):
                x1, x2 = torch.tensor([i]), torch.tensor([j])
                w1 = (plan_pair_select_prob(plan, x1, x2))
                law[i] += a[0, i] * b[0, j] * w1
                law[j] += a[0, i] * b[0, j] * (1 - w1)
        assert torch.allclose(law, plan.p_I[0], atol=1e-12)


def plan_pair_select_prob(plan, x1, x2):
    from tilespec.multidraft.importance import pair_select
    lo = pair_select(plan, x1, x2, torch.tensor([1e-15], dtype=D))
    hi = pair_select(plan, x1, x2, torch.tensor([1 - 1e-15], dtype=D))
    if lo == hi:
        return float(lo.item() == x1.item())
    r1, r2 = plan.rank_of[0, x1], plan.rank_of[0, x2]
    return float(plan.W[0, r1, r2])


def test_k1_chain_matches_reference_bitwise():
    torch.manual_seed(0)
    b, L, v = 500, 3, 7
    tl, dl = torch.randn(b, 1, L + 1, v) * 2, torch.randn(b, 1, L, v) * 2
    dt = torch.multinomial(torch.softmax(dl, -1).view(-1, v), 1).view(b, 1, L)
    ours = verify_multidraft(tl, dt, draft_logits=dl, scheme="sd", seed=11, offsets=5, sampler="cdf")
    ref = verify(tl[:, 0], dt[:, 0], draft_logits=dl[:, 0], seed=11, offsets=5)
    assert torch.equal(ours.output_tokens, ref.output_tokens)
    assert torch.equal(ours.num_accepted, ref.num_accepted)


# ---------------------------------------------------------------- bad input
def test_bad_inputs():
    p, q = t([0.5, 0.5]), t([0.5, 0.5])
    qs, tok = q[:, None], torch.tensor([[0]])
    s = Stream.for_rows(1)
    with pytest.raises(ValueError, match="unknown multi-draft scheme"):
        parse_scheme("bogus")
    with pytest.raises(ValueError, match="sum to 1"):
        select("is", t([0.5, 0.6]), qs, tok, s)
    with pytest.raises(ValueError, match="tokens must lie"):
        select("specinfer", p, qs, torch.tensor([[2]]), s)
    with pytest.raises(ValueError, match=r"qs must be \[N, K, V\]"):
        select("specinfer", p, q, tok, s)
    with pytest.raises(ValueError, match="at least one active"):
        select("specinfer", p, qs, tok, s, mask=torch.tensor([[False]]))
    with pytest.raises(ValueError, match="identical drafts"):
        select("spectr", p, torch.tensor([[[0.5, 0.5], [0.9, 0.1]]], dtype=D), torch.tensor([[0, 1]]), s)
    with pytest.raises(ValueError, match="K must be >= 1"):
        optimal_acceptance(p, q, 0)
    with pytest.raises(ValueError, match="support of at most"):
        optimal_acceptance_brute(np.ones(30) / 30, np.ones((2, 30)) / 30)
    with pytest.raises(ValueError, match="exactly one of target"):
        verify_multidraft(None, torch.zeros(1, 1, 1, dtype=torch.long), draft_probs=torch.ones(1, 1, 1, 2) / 2)
    with pytest.raises(ValueError, match="draft_logits must have shape"):
        verify_multidraft(torch.zeros(1, 2, 2, 3), torch.zeros(1, 2, 1, dtype=torch.long),
                          draft_logits=torch.zeros(1, 1, 1, 3))
    with pytest.raises(ValueError, match="samples must be"):
        run_multidraft_exactness(10)
    with pytest.raises(ValueError, match="alphabet size"):
        select("is-m0", p, qs, tok, s)
