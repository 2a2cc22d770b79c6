"""Structured outputs on the paged engine (engine/paged/grammar.py): outputs in the grammar's language, the same
tokens with and without drafts, the sequence law of the masked target under speculation (G-test, and a planted bug
that fails it), clear refusals."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from tilespec.engine.batching import BatchEngine, BatchRequest
from tilespec.engine.paged import grammar as grammar_module
from tilespec.engine.paged.engine import PagedEngine
from tilespec.exactness.stats import fit_test
from tilespec.verify.distributions import log_probs
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

from engine_models import tiny_lm

pytest.importorskip("xgrammar")

CHARS = 'abcdefgh{}":,0123456789yesno[]'


class CharTokens:
    """Token i is CHARS[i] (ids past it: empty text, never allowed by a grammar); no EOS."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i] if i < len(CHARS) else "" for i in ids)

    def __len__(self):
        return len(CHARS)


def ids(text: str) -> list:
    return [CHARS.index(c) for c in text]


@pytest.fixture(scope="module")
def target():
    model = tiny_lm(3, vocab=64, logit_scale=2.0)
    model.generation_config.eos_token_id = None
    return model


def _run(engine, reqs) -> list:
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1
    return [CharTokens().decode(r.tokens) for r in reqs]


GRAMMARS = [("choice", json.dumps(["yes", "no", "abc"])), ("regex", "[a-c]{2}[0-9]+d"),
            ("json_schema", json.dumps({"type": "object", "properties": {"a": {"enum": [1, 22]}},
                                        "required": ["a"], "additionalProperties": False})),
            ("ebnf", 'root ::= "[" ("a" | "b")* "]"')]


@pytest.mark.parametrize("draft", [None, "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_are_in_the_grammar_and_do_not_depend_on_drafts(target, draft, temperature):
    prompts = [ids("abab{"), ids("yesyes"), ids("a1a1a1"), ids("[ab][ab]")]
    def asks():
        return [BatchRequest(prompt=p, max_tokens=24, temperature=temperature, seed=i, grammar=g)
                for i, (p, g) in enumerate(zip(prompts, GRAMMARS))]
    texts = _run(PagedEngine(target, draft, max_batch=4, gamma=3, block_size=4, tokenizer=CharTokens()), asks())
    alone = _run(PagedEngine(target, None, max_batch=4, block_size=4, tokenizer=CharTokens()), asks())
    assert texts == alone                       # masks are a transform of the target's law: drafts change no token
    choice, regex, schema, ebnf = texts
    assert choice in ("yes", "no", "abc")
    assert re.fullmatch(r"[a-c]{2}[0-9]+d", regex) or len(regex) == 24      # complete, or cut by max_tokens
    assert json.loads(schema) in ({"a": 1}, {"a": 22})
    assert re.fullmatch(r"\[[ab]*\]", ebnf) or len(ebnf) == 24


def test_drafts_outside_the_grammar_are_cut(target):
    """ngram proposes the prompt's repeats; the grammar allows only digits, so every draft is cut before pricing
    and the tokens equal target-only decoding's."""
    engine = PagedEngine(target, "ngram", max_batch=2, gamma=3, block_size=4, tokenizer=CharTokens(), pricing=False)
    req = BatchRequest(prompt=ids("abcabcabc"), max_tokens=8, temperature=0.0, grammar=("regex", "[0-9]{8}"))
    out = _run(engine, [req])[0]
    assert re.fullmatch(r"[0-9]{8}", out) and req.finish_reason == "stop"
    assert engine.counters["drafted"] == 0 or req.accepted == req.drafted


def test_refusals_name_the_fix(target):
    plain = PagedEngine(target, None, max_batch=2, block_size=4)
    with pytest.raises(ValueError, match="tokenizer"):
        plain.submit(BatchRequest(prompt=[1, 2], max_tokens=4, grammar=("json_object", "")))
    engine = PagedEngine(target, None, max_batch=2, block_size=4, tokenizer=CharTokens())
    with pytest.raises(ValueError, match="does not compile"):
        engine.submit(BatchRequest(prompt=[1, 2], max_tokens=4, grammar=("regex", "[a-")))
    with pytest.raises(ValueError, match="kind one of"):
        engine.submit(BatchRequest(prompt=[1, 2], max_tokens=4, grammar=("yaml", "x")))
    with pytest.raises(ValueError, match="non-empty list"):
        engine.submit(BatchRequest(prompt=[1, 2], max_tokens=4, grammar=("choice", "[]")))
    with_draft = PagedEngine(target, tiny_lm(4, vocab=64, layers=1), max_batch=2, gamma=2, block_size=4,
                             tokenizer=CharTokens())
    with pytest.raises(ValueError, match="draft model"):
        with_draft.submit(BatchRequest(prompt=[1, 2], max_tokens=4, grammar=("json_object", "")))
    batch = BatchEngine(target, None, max_batch=2)
    with pytest.raises(ValueError, match="paged engine"):
        batch.submit(BatchRequest(prompt=[1, 2], max_tokens=4, grammar=("json_object", "")))


# ------------------------------------------------------------------------------------------ the sequence law
LAW_VOCAB, LAW = 8, SamplingParams(temperature=1.0)
LAW_GRAMMAR = ("regex", "[a-h][abc][abd]")        # three positions, each its own allowed set
ALLOWED = [ids("abcdefgh"), ids("abc"), ids("abd")]
LAW_PROMPT = ids("abcabcab")                         # repeats: ngram drafts
SAMPLES = 1200


def _masked_law(model) -> np.ndarray:
    """P(x1 x2 x3 | prompt) of the target with each position's logits masked to its allowed set."""
    resolved = resolve_sampling(LAW, 1, "cpu")
    probs = np.zeros([LAW_VOCAB] * 3)
    with torch.no_grad():
        def step(prefix):
            logits = model(torch.tensor([LAW_PROMPT + prefix])).logits[:, -1:, :LAW_VOCAB].float()
            mask = torch.full_like(logits, float("-inf"))
            mask[..., ALLOWED[len(prefix)]] = 0.0
            return torch.exp(log_probs(logits + mask, resolved))[0, 0].double().numpy()
        p1 = step([])
        for a in ALLOWED[0]:
            p2 = step([a])
            for b in ALLOWED[1]:
                p3 = step([a, b])
                for c in ALLOWED[2]:
                    probs[a, b, c] = p1[a] * p2[b] * p3[c]
    return probs.ravel()


@pytest.fixture(scope="module")
def law_model():
    torch.set_num_threads(1)
    model = tiny_lm(21, vocab=LAW_VOCAB, logit_scale=2.0)
    model.generation_config.eos_token_id = None
    return model, _masked_law(model)


def _law_p(law_model) -> float:
    model, law = law_model
    engine = PagedEngine(model, "ngram", max_batch=256, gamma=2, block_size=4, pricing=False, eos_token_id=[],
                         tokenizer=CharTokens())
    reqs = [BatchRequest(prompt=LAW_PROMPT, max_tokens=3, temperature=1.0, seed=7000 + i, grammar=LAW_GRAMMAR)
            for i in range(SAMPLES)]
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    assert engine.counters["drafted"] > 0          # speculation ran under the grammar
    index = [int(np.ravel_multi_index(r.tokens, [LAW_VOCAB] * 3)) for r in reqs]
    result = fit_test(np.bincount(index, minlength=LAW_VOCAB ** 3), law)
    return 0.0 if result.impossible else result.p_value


def test_the_sequence_law_under_a_grammar_is_the_masked_targets(law_model):
    assert _law_p(law_model) > 1e-4


def test_a_mask_leaking_into_the_next_position_fails_the_law_test(law_model, monkeypatch):
    """The planted bug: each draft position also masked with the previous position's mask (the matcher's state one
    draft behind), which stays inside the grammar but removes "d" from the third position whenever a draft is
    verified there: the law test must see it."""
    def leaky(sampling, logits):
        real(sampling, logits)
        for j in range(logits.shape[1] - 1, 0, -1):
            logits[:, j] = torch.where(torch.isinf(logits[:, j - 1]), logits[:, j - 1], logits[:, j])
    real = grammar_module.mask_logits
    monkeypatch.setattr("tilespec.engine.paged.engine.mask_logits", leaky)
    assert _law_p(law_model) < 1e-4


def test_a_grammar_no_token_can_start_is_refused(target):
    engine = PagedEngine(target, None, max_batch=2, block_size=4, tokenizer=CharTokens())
    with pytest.raises(ValueError, match="allows no token"):
        engine.submit(BatchRequest(prompt=[1, 2], max_tokens=4, grammar=("regex", "zz")))
