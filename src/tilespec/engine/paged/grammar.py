"""Structured outputs on the paged engine: a request's grammar (any JSON value, a JSON Schema, a regex, a choice of
strings, an EBNF grammar) as an xgrammar matcher over the target's vocabulary.

Exactness: the grammar is a logit transform of the target's law. At every position a step verifies (the request's
next token, then one per draft) the target's logits are masked to the tokens the grammar allows after the request's
tokens and the drafts before that position (the matcher accepts the drafts in turn, fills one mask row each, then
rolls back), so verify() accepts and resamples under the masked law at each position. Context drafts (ngram,
suffix: a function of the request's own tokens) are cut at the first token the grammar refuses before the step is
priced: a shorter draft, never a different law. A draft model (or a trained head) samples from its own q, whose
refused tokens could not be cut without biasing the resample, so the engine refuses grammars with one. After verify
the emitted tokens advance the matcher; a request ends ("stop") when its grammar terminates (a stop token after a
complete value), also when it ignores EOS. Masks are host work per request and step, so such requests run synchronously
(overlap.plain).

xgrammar (https://github.com/mlc-ai/xgrammar) compiles and caches the grammars; its masks are token bitmasks
applied in place on the logits (CPU or CUDA).
"""
from __future__ import annotations

import json
from typing import Optional

import torch

KINDS = ("json_object", "json_schema", "regex", "choice", "ebnf")


class Grammars:
    """Compiled grammars for one tokenizer and logit width ``vocab`` (the model's rows, which may exceed the
    tokenizer's ids); ``stops``: the engine's EOS ids, the tokens that end a complete value."""

    def __init__(self, tokenizer, vocab: int, stops):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerBase
        self.xgr, self.vocab, self.stops = xgr, vocab, sorted(stops)
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=self.stops or None)
        else:       # any tokenizer with decode(): each id's text, as is (xgrammar's raw vocabulary)
            size = min(vocab, len(tokenizer) if hasattr(tokenizer, "__len__") else vocab)
            info = xgr.TokenizerInfo([tokenizer.decode([i]) for i in range(size)], vocab_size=vocab,
                                     stop_token_ids=self.stops or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, grammar):
        """``grammar`` = (kind, spec) -> a compiled grammar; ValueError naming what is wrong."""
        if not (isinstance(grammar, tuple) and len(grammar) == 2 and grammar[0] in KINDS
                and isinstance(grammar[1], str)):
            raise ValueError(f"grammar must be (kind, spec) with kind one of {KINDS} and spec a string, got "
                             f"{grammar!r}")
        kind, spec = grammar
        try:
            if kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                return self.compiler.compile_json_schema(spec, strict_mode=True)
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            if kind == "choice":
                choices = json.loads(spec)
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                    raise ValueError("a choice is a non-empty list of strings")
                return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
            return self.compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as err:     # xgrammar reports bad grammars as RuntimeError
            raise ValueError(f"the {kind} grammar does not compile: {err}") from None

    def matcher(self, compiled):
        """A matcher for one request (it rolls a step's drafts back after masking)."""
        return self.xgr.GrammarMatcher(compiled, terminate_without_stop_token=not self.stops)  # no EOS: complete ends


def cut_drafts(sampling: list) -> None:
    """Cut each grammar request's drafts (scheduler.Item.seq.drafts) at the first token its grammar refuses."""
    for it in sampling:
        m, drafts = it.seq.matcher, it.seq.drafts
        if m is None or not drafts:
            continue
        kept = 0
        while kept < len(drafts) and m.accept_token(drafts[kept]):
            kept += 1
        if kept:
            m.rollback(kept)
        del drafts[kept:]


def mask_logits(sampling: list, logits: torch.Tensor) -> None:
    """Mask ``logits`` [rows, width, V] in place: for each grammar request (row i), positions 0..k (its k drafts
    accepted before position j) to what its grammar allows there."""
    rows = [(i, it.seq) for i, it in enumerate(sampling) if it.seq.matcher is not None]
    if not rows:
        return
    import xgrammar as xgr
    width, vocab = logits.shape[1], logits.shape[2]
    flat = logits.view(-1, vocab)
    bitmask = xgr.allocate_token_bitmask(flat.shape[0], vocab)
    indices = []
    for i, seq in rows:
        m, drafts = seq.matcher, seq.drafts
        for j in range(1 + len(drafts)):
            if not m.is_terminated():   # past the end the request stops (advance): its row stays as it is
                m.fill_next_token_bitmask(bitmask, i * width + j)
                indices.append(i * width + j)
            if j < len(drafts):
                m.accept_token(drafts[j])
        if drafts:
            m.rollback(len(drafts))
    if indices:
        xgr.apply_token_bitmask_inplace(flat, bitmask.to(flat.device, non_blocking=True), indices=indices)


def advance(matcher, tokens: list) -> tuple:
    """Accept a step's emitted ``tokens`` -> (the tokens up to the one that terminated the grammar, terminated). A
    token the grammar refuses can only come from a position where it allowed none (a dead end of the grammar over
    this vocabulary): the request ends before it."""
    for j, t in enumerate(tokens):
        if not matcher.accept_token(t):     # a state no token of the vocabulary continues: the mask allowed none
            return tokens[:j], True
        if matcher.is_terminated():
            return tokens[:j + 1], True
    return tokens, False


def compiled(engine, req):
    """``req``'s compiled grammar on ``engine`` (a PagedEngine; its Grammars made on first use); ValueError when it
    cannot be served."""
    reason = refusal(engine)
    if reason is not None:
        raise ValueError(reason)
    if engine.grammars is None:
        engine.grammars = Grammars(engine.tokenizer, engine.vocab_out, engine.eos)
    grammar = engine.grammars.compile(req.grammar)
    bitmask = engine.grammars.xgr.allocate_token_bitmask(1, engine.vocab_out)
    engine.grammars.matcher(grammar).fill_next_token_bitmask(bitmask, 0)
    if not bool((bitmask != 0).any()):
        raise ValueError(f"the {req.grammar[0]} grammar allows no token of this model's vocabulary to start with")
    return grammar


def refusal(engine) -> Optional[str]:
    """Why ``engine`` (a PagedEngine) cannot serve grammars (None: it can)."""
    if engine.drafts is not None and engine.trees is None:      # a tree engine's grammar requests draft no tree
        return ("structured outputs are not served with a draft model or a trained head (its sampled drafts cannot "
                "be cut to the grammar without biasing verification): serve with ngram, suffix or no drafts")
    if engine.tokenizer is None:
        return "structured outputs need the engine to have the tokenizer (PagedEngine(..., tokenizer=...))"
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return "structured outputs need xgrammar: pip install xgrammar"
    return None
