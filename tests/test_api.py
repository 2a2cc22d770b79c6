"""The public API (tilespec.generate / transcribe), prompt encoding, and the environment module."""
from __future__ import annotations

import pytest
import torch

import tilespec
from tilespec import env
from tilespec.engine import SpeculativeDecoder
from tilespec.engine.prompts import encode_prompts

from engine_models import layer_skip, stub_whisper_io, tiny_lm, tiny_whisper, whisper_layer_skip


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
                            temperature=0.8, gamma=3, method="reference", seed=5)
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
    """engine="paged": the prompts go through the engine tilespec serve runs on, with the decoder's tokens (T = 0,
    and at T = 1 the same seeded draws: coupled verification of context drafts is target-only decoding); a draft
    model drafts there too (greedy: target-only tokens), a trained head does not."""
    target, draft = pair
    tok = ChatTokenizer()
    for temperature in (0.0, 1.0):
        ref = tilespec.generate(["abcabcabc", "sky"], target=target, tokenizer=tok, max_new_tokens=8,
                                temperature=temperature, seed=3)
        out = tilespec.generate(["abcabcabc", "sky"], target=target, draft="ngram", tokenizer=tok, max_new_tokens=8,
                                temperature=temperature, seed=3, engine="paged", gamma=3, max_batch=2)
        assert out.sequences == ref.sequences and out.texts == ref.texts and out.stats.runtime == "paged"
    greedy = tilespec.generate(["abcabcabc", "sky"], target=target, tokenizer=tok, max_new_tokens=8, temperature=0.0)
    out = tilespec.generate(["abcabcabc", "sky"], target=target, draft=draft, tokenizer=tok, max_new_tokens=8,
                            temperature=0.0, engine="paged", gamma=3, max_batch=2)      # a draft model drafts
    assert out.sequences == greedy.sequences and out.stats.drafted > 0
    with pytest.raises(ValueError, match="BatchEngine"):
        tilespec.generate("x", target=target, draft="head", tokenizer=tok, engine="paged")
    with pytest.raises(ValueError, match="engine must be"):
        tilespec.generate("x", target=target, tokenizer=tok, engine="fast")
    with pytest.raises(ValueError, match="tensor-parallel"):
        tilespec.generate("x", target=target, tokenizer=tok, engine="paged", tp=2)
