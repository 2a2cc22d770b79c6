"""The public API (tilespec.generate / transcribe), prompt encoding, and the environment module."""
from __future__ import annotations

import pytest
import torch

import tilespec
from tilespec import env
from tilespec.engine import SpeculativeDecoder
from tilespec.engine.prompts import encode_prompts

from engine_models import layer_skip, stub_whisper_io, tiny_lm, tiny_whisper, whisper_layer_skip

@pytest.fixture(autouse=True)
def paged_on_cpu(monkeypatch):
    """"auto" takes the paged engine on CUDA only (api.paged_by_default); here the rest of its rule runs on CPU."""
    monkeypatch.setattr("tilespec.api.paged_by_default", lambda target: True)



class ChatTokenizer:
    """Characters <-> ids (vocab 128) with a one-line chat template; id 1 is the BOS special token."""

    chat_template = "<user>{content}<assistant>"
    eos_token_id = 2
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        ids = ([1] if add_special_tokens else []) + [3 + (ord(c) % 120) for c in text]
        return type("Enc", (), {"input_ids": ids})()

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt
        return f"<user>{messages[0]['content']}<assistant>"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids if i > 2)


@pytest.fixture
def pair():
    torch.manual_seed(0)
    target = tiny_lm(0, logit_scale=20.0)
    target.generation_config.eos_token_id = None
    return target, layer_skip(target, 1)


def test_prompts_use_the_chat_template_when_there_is_one_and_raw_text_on_request():
    tok = ChatTokenizer()
    chat = encode_prompts(tok, "hi")
    assert chat == [tok("<user>hi<assistant>", add_special_tokens=False).input_ids]
    assert encode_prompts(tok, ["hi"], chat=False) == [tok("hi").input_ids]
    tok.chat_template = None
    assert encode_prompts(tok, "hi") == [tok("hi").input_ids]


def test_decoder_string_prompts_match_the_cli_encoding(pair):
    target, draft = pair
    dec = SpeculativeDecoder(target, draft, tokenizer=ChatTokenizer())
    ids = encode_prompts(ChatTokenizer(), ["hello"])
    assert dec.generate(prompts=["hello"], max_new_tokens=6).sequences == \
        dec.generate(ids, max_new_tokens=6).sequences
    raw = SpeculativeDecoder(target, draft, tokenizer=ChatTokenizer(), chat=False)
    assert raw._prompt_lists(None, ["hello"]) == [ChatTokenizer()("hello").input_ids]


def test_generate_is_the_decoder_with_options_and_sampling_fields(pair):
    target, draft = pair
    tok = ChatTokenizer()
    out = tilespec.generate(["hello", "sky"], target=target, draft=draft, tokenizer=tok, max_new_tokens=8,
                            temperature=0.8, gamma=3, method="reference", seed=5, engine="decoder")
    dec = SpeculativeDecoder(target, draft, tokenizer=tok, gamma=3,
                             sampling=tilespec.SamplingParams(temperature=0.8))
    ref = dec.generate(encode_prompts(tok, ["hello", "sky"]), max_new_tokens=8, seed=5)
    assert out.sequences == ref.sequences and out.texts == ref.texts and out.stats.drafted > 0
    with pytest.raises(ValueError, match="not both"):
        tilespec.generate("x", target=target, tokenizer=tok, temperature=1.0,
                          sampling=tilespec.SamplingParams())
    with pytest.raises(ValueError, match="no option"):
        tilespec.generate("x", target=target, draft=draft, tokenizer=tok, method_options={"alpha": 1.0})


def test_transcribe_takes_sample_arrays(monkeypatch):
    import numpy as np
    target = tiny_whisper(0)
    draft = whisper_layer_skip(target, 1)
    out = tilespec.transcribe([np.zeros(16000, np.float32)] * 2, target=target, draft=draft,
                              processor=stub_whisper_io(monkeypatch, target),
                              max_new_tokens=4)
    assert len(out.sequences) == 2 and len(out.texts) == 2


def test_env_picks_devices_dtypes_and_folders(monkeypatch, tmp_path):
    assert env.pick_dtype("auto", "cpu") == torch.float32
    assert env.pick_dtype("auto", "cuda") == torch.bfloat16 and env.pick_dtype("fp16") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        env.pick_dtype("half-ish")
    monkeypatch.setenv("TILESPEC_HOME", str(tmp_path))
    monkeypatch.delenv("TILESPEC_DATA", raising=False)
    assert env.data_root() == tmp_path / "data"
    monkeypatch.setenv("TILESPEC_DATA", str(tmp_path / "d"))
    assert env.data_root() == tmp_path / "d"
    rec = env.run_record("cpu")
    assert rec["torch"] == torch.__version__ and rec["device"].startswith("CPU") and "date" in rec


def test_generate_with_a_context_drafter(pair):
    target, _ = pair
    tok = ChatTokenizer()
    out = tilespec.generate("abcabcabc", target=target, draft="ngram", tokenizer=tok, max_new_tokens=6)
    ref = SpeculativeDecoder(target, "ngram", tokenizer=tok).generate(encode_prompts(tok, "abcabcabc"),
                                                                      max_new_tokens=6)
    assert out.sequences == ref.sequences and out.stats.drafter == ref.stats.drafter


def test_generate_verifies_token_trees(pair):
    """tree= / chains= pass through to the one decoder: context trees and a draft model's sampled chains, greedy,
    give target-only's tokens."""
    target, draft = pair
    tok = ChatTokenizer()
    ref = tilespec.generate("abcabcabc", target=target, tokenizer=tok, max_new_tokens=8, temperature=0.0)
    for extra in ({"draft": "ngram", "tree": (3, 3, 8)}, {"draft": draft, "chains": (2, 2)}):
        out = tilespec.generate("abcabcabc", target=target, tokenizer=tok, max_new_tokens=8, temperature=0.0,
                                **extra)
        assert out.sequences == ref.sequences and ":" in out.stats.drafter, extra


def test_verify_is_callable_and_its_modules_import():
    """``tilespec.verify`` is the package and the function: ``import tilespec.verify.registry as r`` works (binding
    the function over the package name broke it) and ``tilespec.verify(...)`` verifies."""
    import inspect

    import torch

    import tilespec
    import tilespec.verify.kernels.launch as launch
    import tilespec.verify.registry as registry
    from tilespec import verify
    res = verify(torch.randn(2, 3, 10), torch.zeros(2, 2, dtype=torch.long), seed=1)
    assert res.method == "reference" and registry.get_method("fused").name == "fused"
    assert callable(launch.fused_verify) and tilespec.verify.verify is tilespec.verify.api.verify
    assert "draft_tokens" in inspect.signature(tilespec.verify).parameters


def test_generate_on_the_paged_engine(pair):
    """The default engine="auto" runs a Llama-family target on the paged engine tilespec serve runs on, with the
    decoder's tokens (T = 0, and at T = 1 the same seeded draws: coupled verification of context drafts is
    target-only decoding, on either engine); a draft model drafts there too (greedy: target-only tokens)."""
    target, draft = pair
    tok = ChatTokenizer()
    prompts, refs = ["abcabcabc", "sky"], {}
    for temperature in (0.0, 1.0):
        ref = refs[temperature] = tilespec.generate(prompts, target=target, tokenizer=tok, max_new_tokens=8,
                                                    temperature=temperature, seed=3, engine="decoder")
        dec = tilespec.generate(prompts, target=target, draft="ngram", tokenizer=tok, max_new_tokens=8,
                                temperature=temperature, seed=3, engine="decoder", method="coupled")
        out = tilespec.generate(prompts, target=target, draft="ngram", tokenizer=tok, max_new_tokens=8,
                                temperature=temperature, seed=3, gamma=3)
        assert out.sequences == dec.sequences == ref.sequences and out.texts == dec.texts == ref.texts
        assert out.finish_reasons == dec.finish_reasons == ["length"] * 2
        assert out.stats.runtime == "paged" and dec.stats.runtime == "eager" and out.stats.drafter == "ngram"
        assert out.stats.new_tokens == 16 and out.stats.emitted >= 16 and out.stats.request_steps >= 8
        assert 0 <= out.stats.match_share <= 1 and out.stats.block_efficiency >= 1
    greedy = refs[0.0]
    explicit = tilespec.generate(prompts, target=target, draft="ngram", tokenizer=tok, max_new_tokens=8,
                                 temperature=0.0, engine="paged", max_batch=1, block_size=8)
    assert explicit.sequences == greedy.sequences
    out = tilespec.generate(prompts, target=target, draft=draft, tokenizer=tok, max_new_tokens=8,
                            temperature=0.0, gamma=3)      # a draft model drafts on the paged engine too
    assert out.sequences == greedy.sequences and out.stats.drafted > 0 and out.stats.runtime == "paged"


def test_auto_picks_the_decoder_for_what_only_it_does(pair):
    """engine="auto": the paged engine wherever it serves the pair and no decoder-only option is given (the server's
    rule, engine/paged/support.choose_engine), else the decoder; paged-only options ask for the paged engine."""
    from tilespec.api import decoder_only, pick_engine
    target, draft = pair
    from tilespec.engine.drafters import HeadDrafter, NgramDrafter, resolve_drafter
    from tilespec.engine.drafters.trees import tree_drafter, tree_shape
    trees = [tree_drafter(d, tree_shape(*shape), tilespec.SamplingParams(), "constant") for d, shape in
             ((NgramDrafter(), ((2, 2, 4), None)), (HeadDrafter(), ((2, 2, 4), None)), (HeadDrafter(), (None, (2, 2))))]
    for d in (None, "ngram", "suffix", draft, [draft, "ngram"], "head", "head+ngram", *trees):
        assert pick_engine(target, d) == "paged"
    tree = tree_drafter(resolve_drafter(draft), tree_shape(None, (2, 2)), tilespec.SamplingParams(), "constant")
    assert pick_engine(target, tree) == "decoder" and pick_engine(tiny_whisper(0), None) == "decoder"
    assert pick_engine(target, None, options={"gamma_schedule": "constant", "gamma": 3, "method": "coupled",
                                              "compile": False, "temperature": 0.5}) == "paged"   # defaults / shared
    for options in ({"gamma_schedule": "optimal"}, {"max_gamma": 8}, {"method_options": {}}, {"compile": "native"}, {"lenience": 0.5}, {"lenience": [1.0, 0.5]},
                    {"gamma": 16}):
        assert pick_engine(target, "ngram", options=options) == "decoder", options
        assert pick_engine(None, None, options=options) == "decoder"      # decided before any model loads
    assert pick_engine(target, None, tp=2) == "decoder" and decoder_only({}, tp=2) == ["tp=2 (no tensor-parallel path)"]
    # token trees: the paged engine takes a context drafter's (and a head's: tests/test_api_trees.py) within its
    # limits; a draft model's sampled chains, or a tree of more draft nodes than a block holds, go to the decoder
    assert pick_engine(target, "ngram", options={"tree": (3, 3, 8)}) == "paged"
    assert pick_engine(target, "ngram", options={"tree": (3, 3, 8), "gamma": 16}) == "paged"     # γ: the depth
    assert pick_engine(target, draft, options={"chains": (2, 2)}) == "decoder"
    assert pick_engine(target, "ngram", options={"tree": (4, 4, 32)}) == "decoder"
    assert pick_engine(target, "ngram", options={"tree": (4, 4, 32), "block_size": 32}) == "paged"
    assert pick_engine(None, None, options={"tree": (3, 3, 8)}) is None          # the drafter decides
    assert pick_engine(None, None) is None                                # the models decide
    assert pick_engine(target, None, options={"max_batch": 2}) == "paged"
    for options in ({"temperature": [0.0, 1.0]}, {"sampling": tilespec.SamplingParams(top_k=[0, 5])}):
        assert pick_engine(target, "ngram", options=options) == "paged", options     # per-prompt values: both take
    tok = ChatTokenizer()
    out = tilespec.generate(["abcabcabc", "sky"], target=target, draft="ngram", tokenizer=tok, max_new_tokens=6,
                            temperature=[0.0, 1.0], gamma_schedule="heuristic")
    assert out.stats.runtime == "eager" and len(out.sequences) == 2


def test_per_prompt_sampling_on_the_paged_engine_is_the_decoders(pair):
    """One temperature / top-k / top-p per prompt (lists or a tensor): the paged engine gives each prompt the
    decoder's seeded tokens (coupled verification of context drafts, as above); a list of the wrong length is an
    error naming the field."""
    import torch
    target, _ = pair
    tok = ChatTokenizer()
    prompts = ["abcabcabc", "sky", "abab"]
    per = dict(temperature=[0.0, 1.0, 0.8], top_k=torch.tensor([0, 5, 3]), top_p=[1.0, 0.9, 1.0])
    dec = tilespec.generate(prompts, target=target, draft="ngram", tokenizer=tok, max_new_tokens=8, seed=7,
                            engine="decoder", method="coupled", **per)
    out = tilespec.generate(prompts, target=target, draft="ngram", tokenizer=tok, max_new_tokens=8, seed=7,
                            engine="paged", gamma=3, **per)
    assert out.sequences == dec.sequences and out.stats.runtime == "paged"
    with pytest.raises(ValueError, match="sampling.top_p has 2 entries for 3 requests"):
        tilespec.generate(prompts, target=target, tokenizer=tok, max_new_tokens=2, engine="paged", top_p=[1.0, 0.9])


def test_paged_refusals_name_the_option_and_the_fix(pair):
    target, draft = pair
    tok = ChatTokenizer()
    from tilespec.engine.drafters import resolve_drafter
    from tilespec.engine.drafters.trees import tree_drafter, tree_shape
    tree = tree_drafter(resolve_drafter(draft), tree_shape(None, (2, 2)), tilespec.SamplingParams(), "constant")
    for kwargs, match in [(dict(draft=tree), "cannot serve this: .* drafts a token tree"),
                          (dict(draft=draft, chains=(2, 2)), "cannot serve this: .* drafts a token tree"),
                          (dict(draft="ngram", tree=(4, 4, 32)),
                           r"cannot honour tree=\(4, 4, 32\) \(31 draft nodes: .* pass block_size=32 .*; use "
                           r"engine='decoder'"),
                          (dict(lenience=0.5), "cannot honour lenience=0.5"),
                          (dict(lenience=[1.0, 0.5]), r"cannot honour lenience=\[1.0, 0.5\]"),
                          (dict(compile="native"), r"compile='native' \(a decoder execution path"),
                          (dict(gamma_schedule="optimal", max_batch=2), "max_batch is the paged engine's: drop it")]:
        with pytest.raises(ValueError, match=match):
            tilespec.generate("x", target=target, tokenizer=tok, engine="paged", **kwargs)
    with pytest.raises(ValueError, match="tensor-parallel"):        # before the (unknown) target loads
        tilespec.generate("x", target="no-such-model", engine="paged", tp=2)
    with pytest.raises(ValueError, match="block_size is the paged engine's, not the decoder's"):
        tilespec.generate("x", target=target, tokenizer=tok, engine="decoder", block_size=8)
    with pytest.raises(TypeError, match="unknown option gama"):
        tilespec.generate("x", target="no-such-model", gama=3)
    with pytest.raises(ValueError, match="engine must be"):
        tilespec.generate("x", target=target, tokenizer=tok, engine="fast")


def test_bad_requests_fail_alike_on_both_engines(pair):
    target, _ = pair
    tok = ChatTokenizer()
    for kwargs in (dict(max_new_tokens=0), dict(seed=[1, 2, 3]), dict(seed=2**63), dict(temperature=-1.0),
                   dict(top_p=0.0), dict(max_new_tokens=2000), dict(temperature=1.0, sampling=tilespec.SamplingParams()),
                   dict(sampling={"temperature": 0.0})):
        errors = []
        for engine in ("decoder", "auto"):
            with pytest.raises((ValueError, TypeError)) as err:
                tilespec.generate(["ab", "cd"], target=target, draft="ngram", tokenizer=tok, engine=engine,
                                  **{"max_new_tokens": 4, **kwargs})
            errors.append(str(err.value))
        assert errors[0] == errors[1], kwargs


def test_the_paged_engine_streams_like_the_decoder(pair):
    """api.make_paged: the paged engine behind the decoder's stream / generate / warmup (what the CLI runs):
    per-step tokens by prompt index add up to the output; a stream left unfinished leaves the engine idle."""
    from tilespec.api import make_paged
    target, draft = pair
    tok = ChatTokenizer()
    ids = encode_prompts(tok, ["abcabcabc", "sky"])
    greedy = tilespec.SamplingParams(temperature=0.0)
    ref = SpeculativeDecoder(target, draft, gamma=3, sampling=greedy, tokenizer=tok).generate(ids, max_new_tokens=8)
    eng = make_paged(target, draft, tok, {"gamma": 3, "sampling": greedy}, ids, 8)
    assert eng.warmup(prompt_len=8, max_new_tokens=2).new_tokens == 2 and eng.last_stats is None
    seen, done = {0: [], 1: []}, []
    for event in eng.stream(ids, max_new_tokens=8, on_finish=done.append):
        for i, tokens in event.tokens.items():
            seen[i] += tokens
    assert [seen[0], seen[1]] == done[0].sequences == ref.sequences and done[0].texts == ref.texts
    assert eng.last_stats is done[0].stats and done[0].stats.new_tokens == 16
    left = eng.stream(ids, max_new_tokens=8)
    next(left)
    left.close()
    assert not eng.engine.has_work and eng.generate(ids, max_new_tokens=8).sequences == ref.sequences


def test_auto_keeps_the_decoder_on_cpu(pair, monkeypatch):
    """On a CPU the paged engine's reference attention is slower than the decoder: "auto" keeps the decoder there."""
    from tilespec import api
    monkeypatch.undo()
    target, _ = pair
    assert next(target.parameters()).device.type == "cpu"
    assert api.pick_engine(target, None) == "decoder" and api.pick_engine(target, None, engine="paged") == "paged"
