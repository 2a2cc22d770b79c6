"""Token ids -> streamed text, with OpenAI's ``stop`` strings.

:class:`TextStream` decodes the whole completion each time tokens arrive and hands out only the new, settled part:
text that may still change is held back (a trailing U+FFFD of an incomplete UTF-8 sequence, and a tail that could be
the start of a stop string). When a stop string appears the text ends before it and ``stopped`` is set (the caller
then cancels the request's decoding). Cost: one decode of the completion per step, fine for completions of a few
thousand tokens.
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, list(stops)
        self.tokens: list = []
        self.sent = 0                       # characters handed out
        self.stopped = False
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def text(self) -> str:
        return self.tok.decode(self.tokens, skip_special_tokens=True)

    def push(self, tokens: list, final: bool = False) -> str:
        """Add tokens; the newly settled text ('' when none). ``final``: the completion ended, flush everything."""
        if self.stopped:
            return ""
        self.tokens += tokens
        text = self.text()
        for stop in self.stops:
            at = text.find(stop, max(0, self.sent - len(stop) + 1))
            if at != -1:
                self.stopped = True
                text = text[:at]
        if not (final or self.stopped):
            end = len(text) - self._hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            text = text[:max(end, self.sent)]
        new = text[self.sent:]
        self.sent = len(text)
        return new
