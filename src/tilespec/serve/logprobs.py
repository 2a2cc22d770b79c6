"""Logprobs in OpenAI's response shapes, from the raw entries the engine sends (messages.Step.logprobs).

An entry is one emitted token's ``(log-probability, [(id, log-probability), ...] top first)``: the target's
log-softmax before temperature, filters and logit transforms (vLLM's default, raw logprobs; docs/engine.md). Turning
ids into text is this process's work, never the engine process's: :class:`TokenText` decodes each id alone, as vLLM
does (``decode([id])`` with special tokens kept, so an EOS shows as itself), once per id. Shapes:

* chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``;
* completions (OpenAI's legacy shape): ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob, ...}],
  "text_offset"}``, where each ``top_logprobs`` dict holds the k alternatives and the chosen token (OpenAI: "up to
  logprobs + 1 elements"; tokens whose strings coincide share a key, as in OpenAI's and vLLM's).

Which tokens go with which text (a stop string cuts both alike) is serve/text.py's ``settled_tokens``. Echo
(completions): :func:`echo_piece` puts the prompt's tokens before a choice's first piece, the first of them with
:data:`NO_ENTRY` (no log-probability: ``token_logprobs`` and ``top_logprobs`` None there, as OpenAI returns), the
others with the engine's prompt entries (messages.Step.prompt_logprobs).
"""
from __future__ import annotations

from typing import Optional

FLOOR = -9999.0     # vLLM's floor: a token the target rules out has -inf, which JSON cannot carry
NO_ENTRY = (None, None)     # a token with no log-probability (an echoed prompt's first)


def _value(lp: Optional[float]) -> Optional[float]:
    return lp if lp is None or lp > FLOOR else FLOOR


class TokenText:
    """Token id -> its string alone, cached (a vocabulary's strings at most; the same ids recur)."""

    def __init__(self, tokenizer):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda i: backend.decode([i], skip_special_tokens=False)     # Rust: same text, faster
        else:
            self._decode = lambda i: tokenizer.decode([i], skip_special_tokens=False)
        self._cache: dict = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self._decode(token) or ""
        return text

    def item(self, token: int, lp: Optional[float]) -> dict:
        """OpenAI's ``{"token", "logprob", "bytes"}``: ``bytes`` is the string's UTF-8 (a token holding part of a
        character decodes to U+FFFD, whose bytes they then are, as in vLLM)."""
        text = self(token)
        return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8", errors="replace"))}


def chat_logprobs(strings: TokenText, ids: list, entries: list, starts: list) -> dict:
    """The chat shape for tokens ``ids`` with their ``entries`` (``starts`` unused: chat has no offsets)."""
    content = []
    for token, entry in zip(ids, entries):
        item = strings.item(token, None if entry is None else entry[0])     # None: the engine sent no entry
        item["top_logprobs"] = [strings.item(t, lp) for t, lp in entry[1]] if entry is not None else []
        content.append(item)
    return {"content": content}


def completion_logprobs(strings: TokenText, ids: list, entries: list, starts: list) -> dict:
    """OpenAI's legacy shape for tokens ``ids`` with their ``entries``; ``text_offset`` is ``starts``, each token's
    position in the completion's text (from the detokenized text: a token decoded alone may lack a leading space
    the text has, so summing the strings' lengths would drift)."""
    tokens, values, tops = [], [], []
    for token, entry in zip(ids, entries):
        text = strings(token)
        tokens.append(text)
        value = None if entry is None else _value(entry[0])
        values.append(value)
        top = {} if entry is None else None if entry[1] is None else {strings(t): _value(lp) for t, lp in entry[1]}
        if top is not None and entry is not None:
            top.setdefault(text, value)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": list(starts)}


class Echo:
    """An echoed prompt (completions' ``echo``): its ``text`` (the prompt as given, or its ids decoded), ``ids`` and
    each token's ``starts`` in the prompt's detokenized text."""

    __slots__ = ("text", "ids", "starts")

    def __init__(self, text: str, ids: list, starts: list):
        self.text, self.ids, self.starts = text, ids, starts


def echo_piece(echo: Echo, prompt_entries: Optional[list], piece: tuple) -> tuple:
    """A choice's first logprobs piece (ids, entries, offsets) with the prompt's tokens before it: the first with
    NO_ENTRY, the rest with ``prompt_entries`` (None where the engine sent none)."""
    ids, entries, starts = piece
    got = list(prompt_entries or [])[:len(echo.ids) - 1]
    prompt = [NO_ENTRY] + got + [None] * (len(echo.ids) - 1 - len(got))
    return echo.ids + list(ids), prompt[:len(echo.ids)] + list(entries), echo.starts + list(starts)
