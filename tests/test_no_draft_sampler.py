"""Steps without drafts (target-only decoding, a schedule's fallback, a served request with speculation switched
off) sample with ``registry.no_draft_method``: ``fused`` on a GPU for every method that makes keyed draws, and
``coupled`` draws its positions with the same sampler there. The token is then the same draw as the chosen method's
(same keyed uniform, same inverse CDF), so outputs do not change; these tests run the GPU choice on the CPU through
the Triton interpreter (``_fused_sampler_on`` patched) and compare with the PyTorch draws."""
from __future__ import annotations

import pytest
import torch

import tilespec
from tilespec.engine import SpeculativeDecoder
from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.verify import registry
from tilespec.verify.kernels import launch
from tilespec.verify.types import SamplingParams

from engine_models import tiny_lm
from test_coupled import target_only_case


@pytest.fixture
def fused_sampler(monkeypatch):
    """Take the GPU's choice on this CPU (the interpreter runs ``fused``) and count fused launches."""
    calls = []
    real = launch.fused_verify

    def counted(inputs):
        calls.append(inputs.max_draft)
        return real(inputs)

    monkeypatch.setattr(registry, "_fused_sampler_on", lambda device: True)
    monkeypatch.setattr(launch, "fused_verify", counted)
    return calls


def test_which_method_samples_a_step_without_drafts(monkeypatch):
    assert not registry._fused_sampler_on(torch.device("cpu"))
    monkeypatch.setattr(registry, "_fused_sampler_on", lambda device: getattr(device, "type", device) == "cuda")
    for name in ("reference", "coupled", "tiled", "fused"):
        assert registry.no_draft_method(name, torch.device("cuda")) == "fused"
        assert registry.no_draft_method(name, torch.device("cpu")) == name
    for name in ("hf", "sigmoid"):    # a torch generator's draws; not exact
        assert registry.no_draft_method(name, torch.device("cuda")) == name


def test_coupled_draws_with_the_fused_sampler_are_the_target_only_draws(fused_sampler):
    with pytest.MonkeyPatch.context() as mp:      # the PyTorch draws
        mp.setattr(registry, "_fused_sampler_on", lambda device: False)
        logits, seeds, offsets, sampling, alone, drafts = target_only_case(24, 3, 16)
    res = tilespec.verify(logits, drafts, sampling=sampling, method="coupled", seed=seeds, offsets=offsets)
    assert fused_sampler == [0]                       # one fused call: every position a row without drafts
    for i in range(len(drafts)):
        n = int(res.num_emitted[i])
        assert res.output_tokens[i, :n].tolist() == alone[i, :n].tolist()


@pytest.mark.parametrize("method,runtime", [("reference", False), ("coupled", False), ("reference", "native")])
def test_target_only_decoding_samples_with_fused_and_keeps_its_tokens(fused_sampler, method, runtime):
    torch.set_num_threads(1)
    target = tiny_lm(0, logit_scale=4.0)
    prompts = [[5, 6, 7, 8], [9, 10]]
    sampling = SamplingParams(temperature=1.0, top_k=20)

    def run():
        dec = SpeculativeDecoder(target, None, method=method, sampling=sampling, eos_token_id=[], compile=runtime)
        return dec.generate(prompts, max_new_tokens=10, seed=3).sequences

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_fused_sampler_on", lambda device: False)
        own = run()
    assert fused_sampler == []
    assert run() == own
    assert fused_sampler and set(fused_sampler) == {0}


@pytest.mark.parametrize("runtime", [False, "native"])
def test_served_coupled_speculation_keeps_target_only_tokens_with_the_fused_sampler(fused_sampler, runtime):
    torch.set_num_threads(1)
    target = tiny_lm(0, logit_scale=20.0)     # peaked laws: n-gram drafts get accepted
    target.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9]]

    def run(draft):
        engine = BatchEngine(target, draft, max_batch=2, gamma=3, max_len=40, method="coupled", compile=runtime)
        reqs = [BatchRequest(prompt=p, max_tokens=16 - 6 * i, temperature=1.0, seed=11 + i)
                for i, p in enumerate(prompts)]
        for r in reqs:
            engine.submit(r)
        while engine.has_work:
            engine.step()
        return [r.tokens for r in reqs], engine.counters["accepted"]

    plain, _ = run(None)
    spec, accepted = run("ngram")
    assert spec == plain and accepted > 0
    assert 0 in fused_sampler


def test_auto_is_the_fastest_exact_method_of_the_device(monkeypatch):
    assert registry.resolve_method("auto", torch.device("cpu")) == "reference"
    assert registry.resolve_method("sigmoid", torch.device("cpu")) == "sigmoid"
    res = tilespec.verify(torch.randn(2, 3, 10), torch.zeros(2, 2, dtype=torch.long), method="auto", seed=1)
    assert res.method == "reference"
    assert SpeculativeDecoder(tiny_lm(0), None).method == "reference"
    assert BatchEngine(tiny_lm(0), None, method="auto").method == "reference"
    monkeypatch.setattr(registry, "_fused_sampler_on", lambda device: getattr(device, "type", device) == "cuda")
    assert registry.resolve_method("auto", torch.device("cuda")) == "fused"
    with pytest.raises(ValueError, match="'auto'"):
        registry.get_method("fusd")


def test_coupled_with_fused_draws_passes_the_exactness_suite(fused_sampler):
    """The GPU path of ``coupled`` (every position's draw by ``fused``) holds the exact law in every suite case."""
    from tilespec.exactness.suite import run_suite
    results = run_suite(["coupled"], samples=40_000, power_check=False)   # the CPU tier's size
    assert fused_sampler and len(results) >= 16
    assert not [(r.case, r.min_p_value) for r in results if not r.passed]
