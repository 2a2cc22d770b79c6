"""The engine's bad-input sweep: every request either decodes or fails before any forward with one
clear error naming the problem and the fix; several streams of one decoder never mix their state."""
import itertools

import pytest
import torch

from engine_models import layer_skip, tiny_lm
from tilespec import SamplingParams
from tilespec.engine import SpeculativeDecoder
from tilespec.engine.inputs import check_request, context_limit

pytestmark = pytest.mark.usefixtures("one_thread")
CONTEXT = 1024   # tiny_lm's max_position_embeddings


@pytest.fixture(scope="module")
def models():
    target = tiny_lm(0, logit_scale=3.0)
    return {"target": target, "draft": layer_skip(target, 1)}


@pytest.fixture(scope="module")
def dec(models):
    return SpeculativeDecoder(models["target"], models["draft"], gamma=3, eos_token_id=[])


def greedy_target(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("prompts,msg", [([[]], "prompt 0 is empty; every request needs at least one token"),
                                         ([[1, 2], []], "prompt 1 is empty"),
                                         ([], "no prompts given")])
def test_empty_prompts(dec, prompts, msg):
    with pytest.raises(ValueError, match=msg):
        dec.generate(prompts, max_new_tokens=3)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        dec.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)


def test_prompt_longer_than_the_context(dec):
    assert context_limit(dec.target) == CONTEXT
    with pytest.raises(ValueError, match=rf"a prompt has {CONTEXT + 6} tokens but the target's context is "
                                         rf"{CONTEXT} positions \(max_position_embeddings\): shorten it to at most "
                                         rf"{CONTEXT - 1}"):
        dec.generate([[1] * (CONTEXT + 6)], max_new_tokens=3)
    with pytest.raises(ValueError, match=r"prompt \(1020 tokens\) \+ max_new_tokens \(10\) exceeds the target's "
                                         r"context of 1024 positions.*lower max_new_tokens to at most 4"):
        dec.generate([[1] * 1020], max_new_tokens=10)
    assert len(dec.generate([[1] * 1020], max_new_tokens=4).sequences[0]) == 4   # the fix the message names


def test_draft_with_a_shorter_context_is_checked_too(models):
    class Short:   # the draft's config says 16 positions; nothing else is read before the error
        config = type("C", (), {"max_position_embeddings": 16})()
    with pytest.raises(ValueError, match="exceeds the draft's context of 16 positions"):
        check_request(models["target"], Short(), [[1, 2, 3]], 14)


@pytest.mark.parametrize("bad", [-1, 128, 10_000])
def test_prompt_ids_outside_the_vocabulary(dec, bad):
    with pytest.raises(ValueError, match=rf"prompt 1 holds token id {bad}, outside the model's vocabulary \[0, 128\): "
                                         r"encode prompts with the model's own tokenizer"):
        dec.generate([[1, 2], [3, bad]], max_new_tokens=2)


@pytest.mark.parametrize("n", [0, -1, 2.0, None])
def test_max_new_tokens_zero_negative_or_not_an_int(dec, n):
    with pytest.raises(ValueError, match=rf"max_new_tokens must be an integer >= 1, got {n!r}"):
        dec.generate([[1, 2]], max_new_tokens=n)


def test_draft_with_another_vocabulary_or_device(models):
    with pytest.raises(ValueError, match="vocabulary mismatch: target has 128 output tokens, draft has 64"):
        SpeculativeDecoder(models["target"], tiny_lm(5, vocab=64))
    with pytest.raises(ValueError, match=r"target is on cpu but draft on meta: move both to one device, "
                                         r"e.g. draft.to\(target.device\)"):
        SpeculativeDecoder(models["target"], layer_skip(models["target"], 1).to("meta"))


def test_draft_in_another_dtype_works_and_stays_exact(models):
    """A bf16 draft under an fp32 target decodes (verify computes in fp32); greedy output is the target's."""
    target = models["target"]
    draft = layer_skip(target, 1).to(torch.bfloat16)
    dec = SpeculativeDecoder(target, draft, gamma=3, sampling=SamplingParams.greedy(), eos_token_id=[])
    assert dec.generate([[5, 6, 7]], max_new_tokens=10).sequences[0] == greedy_target(target, [5, 6, 7], 10)


def test_eos_inside_the_prompt_does_not_stop_generation(models):
    target = models["target"]
    prompt = [5, 9, 5, 3]
    dec = SpeculativeDecoder(target, models["draft"], gamma=3, sampling=SamplingParams.greedy(), eos_token_id=5)
    expected = greedy_target(target, prompt, 8)
    out = dec.generate([prompt], max_new_tokens=8)
    cut = expected.index(5) + 1 if 5 in expected else len(expected)
    assert out.sequences[0] == expected[:cut]
    assert out.finish_reasons[0] == ("eos" if 5 in expected else "length")


def test_same_seed_twice_gives_the_same_tokens(dec):
    a = dec.generate([[1, 2, 3], [9]], max_new_tokens=12, seed=4).sequences
    assert dec.generate([[1, 2, 3], [9]], max_new_tokens=12, seed=4).sequences == a
    assert dec.generate([[1, 2, 3], [9]], max_new_tokens=12, seed=[4, 5]).sequences == a
    assert dec.generate([[1, 2, 3], [9]], max_new_tokens=12, seed=5).sequences != a


def test_seed_list_of_the_wrong_length(dec):
    with pytest.raises(ValueError, match="got 1 seeds for 2 requests"):
        dec.generate([[1], [2]], max_new_tokens=2, seed=[1])


def _collect(stream) -> list:
    return [t for event in stream for t in event.tokens.get(0, [])]


def _two_interleaved_streams(dec) -> tuple[list, list]:
    """Generate two requests alone, then as two interleaved streams on ``dec``: both ways must agree.
    Returns the two token lists."""
    a = dec.generate([[1, 2, 3]], max_new_tokens=10, seed=4).sequences[0]
    b = dec.generate([[7, 8]], max_new_tokens=10, seed=9).sequences[0]
    got_a, got_b = [], []
    for ea, eb in itertools.zip_longest(dec.stream([[1, 2, 3]], max_new_tokens=10, seed=4),
                                        dec.stream([[7, 8]], max_new_tokens=10, seed=9)):
        got_a += ea.tokens.get(0, []) if ea else []
        got_b += eb.tokens.get(0, []) if eb else []
    assert (got_a, got_b) == (a, b)
    return a, b


# [debug]: -m slow (dynamo tracing, the suite's slowest test); every compiled mode takes the same runner leases
# (engine/leases.py): [native] interleaves two streams on shared runners, and the debug runners' leases run by
# default in test_stream_abandoned_midway_then_reused[debug]
@pytest.mark.parametrize("compile", [False, pytest.param("debug", marks=pytest.mark.slow), "native"])
def test_two_streams_on_one_decoder(models, compile):
    dec = SpeculativeDecoder(models["target"], models["draft"], gamma=3, eos_token_id=[], compile=compile)
    a, b = _two_interleaved_streams(dec)
    # a generate() while a stream is open, then the stream resumes: neither changes the other's result
    open_stream = dec.stream([[1, 2, 3]], max_new_tokens=10, seed=4)
    first = next(open_stream).tokens.get(0, [])
    out = dec.generate([[7, 8]], max_new_tokens=10, seed=9)
    assert first + _collect(open_stream) == a
    assert out.sequences[0] == b


@pytest.mark.parametrize("compile", ["debug", "native"])
def test_stream_abandoned_midway_then_reused(models, compile):
    # debug: γ = 1 keeps the number of shapes dynamo traces (and the test time) small
    dec = SpeculativeDecoder(models["target"], models["draft"], gamma=1 if compile == "debug" else 3, eos_token_id=[],
                             compile=compile)
    expected = dec.generate([[4, 4]], max_new_tokens=8, seed=1).sequences
    for close in (True, False):
        stream = dec.stream([[4, 4]], max_new_tokens=8, seed=1)
        next(stream)
        if close:
            stream.close()          # released at once; otherwise it stays open and holds its runners
        assert dec.generate([[4, 4]], max_new_tokens=8, seed=1).sequences == expected
        assert _collect(dec.stream([[4, 4]], max_new_tokens=8, seed=1)) == expected[0]


@pytest.mark.parametrize("seed,err,msg", [(2**63 - 1, ValueError, "seed 9223372036854775808 is not an integer"),
                                          ([1, 2**64], ValueError, "seed 18446744073709551616 is not an integer"),
                                          ([1, 2.5], ValueError, "seed 2.5 is not an integer"),
                                          (1.5, TypeError, "seed must be an int .* got float"),
                                          ([1, 2, 3], ValueError, "got 3 seeds for 2 requests")])
def test_bad_seeds_fail_before_any_work(dec, seed, err, msg):
    with pytest.raises(err, match=msg):
        dec.generate([[1], [2]], max_new_tokens=2, seed=seed)


def test_tensor_and_numpy_seeds_work(dec):
    import numpy as np
    a = dec.generate([[1], [2]], max_new_tokens=4, seed=[3, 4]).sequences
    assert dec.generate([[1], [2]], max_new_tokens=4, seed=torch.tensor([3, 4])).sequences == a
    assert dec.generate([[1], [2]], max_new_tokens=4, seed=np.int64(3)).sequences == a


def test_per_request_sampling_of_the_wrong_length(models):
    dec = SpeculativeDecoder(models["target"], models["draft"], sampling=SamplingParams(temperature=[0.5, 1.0, 0.7]))
    with pytest.raises(ValueError, match="sampling.temperature has 3 entries for 2 requests: give one value per"):
        dec.generate([[1], [2]], max_new_tokens=2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compile", ["graphs", "native-graphs"])
def test_two_streams_and_an_abandoned_one_on_cuda_graphs(compile):
    """The lease of shared graph runners on the real CUDA-graph paths (run with -m gpu on the GPU machine)."""
    target = tiny_lm(0, logit_scale=3.0).cuda()
    dec = SpeculativeDecoder(target, layer_skip(target, 1).cuda(), gamma=3, eos_token_id=[], compile=compile)
    a, b = _two_interleaved_streams(dec)
    abandoned = dec.stream([[1, 2, 3]], max_new_tokens=10, seed=4)
    next(abandoned)
    assert dec.generate([[7, 8]], max_new_tokens=10, seed=9).sequences[0] == b
    abandoned.close()
    assert dec.generate([[1, 2, 3]], max_new_tokens=10, seed=4).sequences[0] == a
