"""Continuous batching with per-request logit transforms and stop rules (BatchRequest.logits / stop_token_ids /
ignore_eos): speculative decoding under transforms gives target-only decoding's tokens under the same transforms
(coupled + n-gram at T > 0, a draft model at T = 0), amid requests without transforms; stop ids end a request,
min_tokens holds them off, ignore_eos runs to the length. The law at T > 0 with sampled drafts:
tests/test_logit_transforms.py."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.verify.logit_transforms import LogitSettings

from engine_models import tiny_lm

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9], [3, 4, 3, 4]]
PENALISED = LogitSettings(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 2.0, 8: -5.0})


@pytest.fixture(scope="module")
def target():
    torch.set_num_threads(1)
    model = tiny_lm(0, logit_scale=20.0)       # peaked laws: outputs repeat, so n-gram drafts get accepted
    model.generation_config.eos_token_id = None
    return model


def run(target, draft, requests, method="coupled", eos=None):
    engine = BatchEngine(target, draft, max_batch=4, gamma=3, max_len=64, method=method, eos_token_id=eos)
    for r in requests:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    return [(r.tokens, r.finish_reason) for r in requests], engine


def asks(temperature, logits=PENALISED):
    """Three requests with transforms and one without (it shares the steps)."""
    return [BatchRequest(prompt=p, max_tokens=20, temperature=temperature, seed=3 + i, logits=logits)
            for i, p in enumerate(PROMPTS)] + [BatchRequest(prompt=[5, 6, 5, 6], max_tokens=12, temperature=temperature,
                                                            seed=9)]


def test_ngram_under_transforms_gives_the_target_only_tokens(target):
    plain, _ = run(target, None, asks(1.0))
    spec, engine = run(target, "ngram", asks(1.0))
    assert spec == plain
    assert engine.counters["accepted"] > 0
    untransformed, _ = run(target, None, asks(1.0, logits=None))
    assert untransformed[:3] != plain[:3] and untransformed[3] == plain[3]    # they act, on their rows only


def test_draft_model_under_transforms_at_t0_gives_the_target_only_tokens(target):
    draft = tiny_lm(1, layers=1, logit_scale=20.0)
    plain, _ = run(target, None, asks(0.0), method="reference")
    spec, engine = run(target, draft, asks(0.0), method="reference")
    assert spec == plain and engine.counters["drafted"] > 0
    for tokens, _ in plain[:3]:
        assert 8 not in tokens         # logit_bias -5 at T = 0 on peaked logits: never the argmax here


def test_stop_token_ids_min_tokens_and_ignore_eos(target):
    (base, _), = run(target, None, [BatchRequest(prompt=PROMPTS[0], max_tokens=16, temperature=0.0)])[0]
    stop = base[2]
    first = base.index(stop)
    (cut, reason), = run(target, None, [BatchRequest(prompt=PROMPTS[0], max_tokens=16, temperature=0.0,
                                                     stop_token_ids=(stop,))])[0]
    assert cut == base[:first + 1] and reason == "stop"
    held = BatchRequest(prompt=PROMPTS[0], max_tokens=16, temperature=0.0, stop_token_ids=(stop,),
                        logits=LogitSettings(min_tokens=first + 2))
    (late, _), = run(target, "ngram", [held])[0]
    assert stop not in late[:first + 2] and late[:first] == base[:first]
    (eos_cut, reason), = run(target, None, [BatchRequest(prompt=PROMPTS[0], max_tokens=16, temperature=0.0)],
                             eos=stop)[0]
    assert eos_cut == base[:first + 1] and reason == "stop"
    (whole, reason), = run(target, "ngram", [BatchRequest(prompt=PROMPTS[0], max_tokens=16, temperature=0.0,
                                                          ignore_eos=True)], eos=stop)[0]
    assert whole == base and reason == "length"


def test_bad_transform_values_fail_at_submission(target):
    engine = BatchEngine(target, None, max_batch=2, max_len=32)
    with pytest.raises(ValueError, match="frequency_penalty"):
        engine.submit(BatchRequest(prompt=[1, 2], max_tokens=2, logits=LogitSettings(frequency_penalty=9.0)))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.submit(BatchRequest(prompt=[1, 2], max_tokens=2, stop_token_ids=(10_000,)))


def test_a_prompt_over_the_context_says_by_how_much(target):
    engine = BatchEngine(target, None, max_batch=2, max_len=32)
    with pytest.raises(ValueError, match="the prompt is 40 tokens, 8 over the context of 32 positions; shorten it"):
        engine.submit(BatchRequest(prompt=[1] * 40, max_tokens=2))
    with pytest.raises(ValueError, match="lower max_tokens to at most 2"):
        engine.submit(BatchRequest(prompt=[1] * 30, max_tokens=5))


@pytest.mark.gpu
def test_transforms_on_the_gpu_native_runtime():
    """compile=True on CUDA: transformed steps leave the whole-step graphs for the host-commit path (native-graphs
    forwards) and still give target-only decoding's tokens under the same transforms."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = tiny_lm(0, logit_scale=20.0).cuda()
    model.generation_config.eos_token_id = None

    def go(draft):
        engine = BatchEngine(model, draft, max_batch=4, gamma=3, max_len=64, method="coupled", compile=True)
        reqs = asks(1.0)
        for r in reqs:
            engine.submit(r)
        while engine.has_work:
            engine.step()
        return [r.tokens for r in reqs], engine.counters["accepted"]

    (plain, _), (spec, accepted) = go(None), go("ngram")
    assert spec == plain and accepted > 0
