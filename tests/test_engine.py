"""SpeculativeDecoder: greedy speculative output equals target-only greedy output, token for token (CPU, fp32)."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import GammaSchedule, SpeculativeDecoder, optimal_gamma
from tilespec.verify import SamplingParams

from engine_models import layer_skip, tiny_lm


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_lm(0, logit_scale=20.0)
    return {"target": target, "skip": layer_skip(target, 1), "random": tiny_lm(1, layers=1, logit_scale=20.0)}


PROMPTS = [[5, 17, 33, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [100, 3]]


def hf_greedy(model, prompt, n, eos=None):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("draft_name", ["skip", "random"])
@pytest.mark.parametrize("gamma,schedule", [(1, "constant"), (3, "constant"), (5, "heuristic"), (4, "optimal")])
def test_greedy_equals_target_batched(models, draft_name, gamma, schedule):
    target, draft = models["target"], models[draft_name]
    expected = [hf_greedy(target, p, 24) for p in PROMPTS]
    dec = SpeculativeDecoder(target, draft, gamma=gamma, gamma_schedule=schedule, max_gamma=8,
                             sampling=SamplingParams.greedy(), eos_token_id=[])
    out = dec.generate(PROMPTS, max_new_tokens=24)
    assert out.sequences == expected
    single = dec.generate([PROMPTS[2]], max_new_tokens=24)
    assert single.sequences[0] == expected[2]
    stats = out.stats
    assert stats.new_tokens == 24 * len(PROMPTS)
    assert 0.0 <= stats.alpha <= 1.0 and stats.block_efficiency >= 1.0
    if draft_name == "random":
        assert stats.alpha < 0.5  # a draft that disagrees a lot


def test_skip_draft_accepts_and_qwen_family():
    target = tiny_lm(3, family="qwen2", logit_scale=20.0)
    draft = layer_skip(target, 1)
    dec = SpeculativeDecoder(target, draft, gamma=4, sampling=SamplingParams.greedy(), eos_token_id=[])
    out = dec.generate(PROMPTS[:2], max_new_tokens=20)
    assert out.sequences == [hf_greedy(target, p, 20) for p in PROMPTS[:2]]
    self_spec = SpeculativeDecoder(target, target, gamma=4, sampling=SamplingParams.greedy(), eos_token_id=[])
    out = self_spec.generate(PROMPTS[:2], max_new_tokens=20)
    assert out.stats.alpha == 1.0 and out.stats.block_efficiency > 4.0


def test_target_only_and_hf_method(models):
    target = models["target"]
    expected = [hf_greedy(target, p, 12) for p in PROMPTS]
    ar = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy(), eos_token_id=[])
    assert ar.generate(PROMPTS, max_new_tokens=12).sequences == expected
    hf = SpeculativeDecoder(target, models["skip"], gamma=3, method="hf", sampling=SamplingParams.greedy(),
                            eos_token_id=[])
    assert hf.generate(PROMPTS, max_new_tokens=12).sequences == expected


def test_eos_and_length(models):
    target = models["target"]
    ref = hf_greedy(target, PROMPTS[0], 20)
    eos = ref[6]
    first = ref.index(eos)
    dec = SpeculativeDecoder(target, models["skip"], gamma=5, sampling=SamplingParams.greedy(), eos_token_id=eos)
    out = dec.generate(PROMPTS[:2], max_new_tokens=20)
    assert out.sequences[0] == ref[:first + 1] and out.finish_reasons[0] == "eos"
    other = hf_greedy(target, PROMPTS[1], 20, eos=eos)
    assert out.sequences[1] == other
    events = list(dec.stream(PROMPTS[:1], max_new_tokens=3))
    assert sum(len(e.tokens.get(0, [])) for e in events) == min(3, first + 1)
    assert events[-1].finished == [0]


def test_long_generation_defragments(models):
    target = models["target"]
    prompts = [[3] * 2, [4] * 9, [5, 6, 7]]
    expected = [hf_greedy(target, p, 90) for p in prompts]
    dec = SpeculativeDecoder(target, models["skip"], gamma=6, sampling=SamplingParams.greedy(), eos_token_id=[],
                             cache_slack=0)
    out = dec.generate(prompts, max_new_tokens=90)
    assert out.sequences == expected
    assert out.stats.defrags >= 1


def test_bad_inputs(models):
    target, draft = models["target"], models["skip"]
    with pytest.raises(ValueError, match="gamma schedule"):
        SpeculativeDecoder(target, draft, gamma_schedule="fastest")
    with pytest.raises(ValueError, match="gamma must be"):
        SpeculativeDecoder(target, draft, gamma=0)
    with pytest.raises(ValueError, match="unknown verification method"):
        SpeculativeDecoder(target, draft, method="nope")
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        SpeculativeDecoder(target, tiny_lm(5, vocab=64))
    with pytest.raises(TypeError, match="Hugging Face model"):
        SpeculativeDecoder("gpt", draft)
    dec = SpeculativeDecoder(target, draft)
    with pytest.raises(ValueError, match="empty"):
        dec.generate([[1, 2], []], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="tokenizer"):
        dec.generate(prompts="hello", max_new_tokens=4)
    with pytest.raises(ValueError, match="exactly one"):
        dec.generate(max_new_tokens=4)


def test_gamma_schedules():
    h = GammaSchedule("heuristic", 5)
    assert h.next() == 5
    h.update(5, [5, 5])
    assert h.next() == 7
    h.update(7, [7, 2])
    assert h.next() == 6
    for _ in range(10):
        h.update(h.next(), [0])
    assert h.next() == 1
    assert optimal_gamma(0.0, 0.1) == 1
    assert optimal_gamma(0.9, 0.05) > optimal_gamma(0.6, 0.05)
    o = GammaSchedule("optimal", 3, max_gamma=12)
    for _ in range(50):
        o.update(o.next(), [o.next()], draft_time=0.01 * o.next(), target_time=0.2)
    assert o.alpha > 0.9 and abs(o.cost_ratio - 0.05) < 1e-9 and o.next() >= 8


def test_bf16_padding_rows_stay_finite(models):
    target = models["target"].to(torch.bfloat16)
    try:
        dec = SpeculativeDecoder(target, target, gamma=4, sampling=SamplingParams.greedy(), eos_token_id=[])
        out = dec.generate(PROMPTS[:2], max_new_tokens=6)
        assert out.stats.alpha > 0.8  # self-drafting: only bf16 rounding of chunked vs single forwards differs
        assert all(0 <= t < 128 for s in out.sequences for t in s)
    finally:
        target.to(torch.float32)


def test_compiled_path_static_shapes(models):
    """compile="debug" traces the forwards with dynamo (eager backend): static batch, zombies, runner reuse."""
    target = models["target"]
    expected = [hf_greedy(target, p, 10) for p in PROMPTS[:2]]
    dec = SpeculativeDecoder(target, models["skip"], gamma=1, sampling=SamplingParams.greedy(), eos_token_id=[],
                             compile="debug")  # γ = 1 keeps the number of traced shapes (and test time) small
    assert dec.generate(PROMPTS[:2], max_new_tokens=10).sequences == expected
    eos = expected[0][2]
    dec.eos = {eos}
    out = dec.generate(PROMPTS[:2], max_new_tokens=10)  # request 0 stops early and stays as an ignored row
    assert out.sequences[0] == expected[0][:expected[0].index(eos) + 1]
    assert out.sequences[1] == hf_greedy(target, PROMPTS[1], 10, eos=eos)
