"""Token ids -> streamed text, with OpenAI's ``stop`` strings.

:class:`TextStream` turns each batch of new tokens into new text incrementally (serve/detokenize.py: a few tokens of
context are decoded, never the whole completion) and hands out only the settled part: a tail that could be the start
of a stop string is held back until it cannot be. When a stop string appears the text ends before it and ``stopped``
is set (the caller then cancels the request's decoding). The text of a completion equals the tokenizer's decode of
all its tokens (tests/test_detokenize.py).
"""
from __future__ import annotations

from .detokenize import IncrementalDetokenizer


class TextStream:
    def __init__(self, decode, stops: list[str]):
        self.detok = IncrementalDetokenizer(decode)
        self.stops = list(stops)
        self.text = ""                      # settled text so far (before any stop string)
        self.sent = 0                       # characters handed out
        self.stopped = False
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    @property
    def tokens(self) -> list:
        return self.detok.ids

    def push(self, tokens: list, final: bool = False) -> str:
        """Add tokens; the newly settled text ('' when none). ``final``: the completion ended, flush everything."""
        if self.stopped:
            return ""
        old = len(self.text)
        self.text += self.detok.push(tokens) if tokens else ""
        if final:
            self.text += self.detok.flush()
        for stop in self.stops:
            at = self.text.find(stop, max(0, old - len(stop) + 1))
            if at != -1:
                self.stopped = True
                self.text = self.text[:at]
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self._hold)
        new = self.text[self.sent:end]
        self.sent = end
        return new
