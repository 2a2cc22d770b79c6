"""Token ids -> streamed text, with OpenAI's ``stop`` strings.

:class:`TextStream` turns each batch of new tokens into new text incrementally (serve/detokenize.py: a few tokens of
context are decoded, never the whole completion) and hands out only the settled part: a tail that could be the start
of a stop string is held back until it cannot be. When a stop string appears the text ends before it and ``stopped``
is set (the caller then cancels the request's decoding). The text of a completion equals the tokenizer's decode of
all its tokens (tests/test_detokenize.py).

With ``track`` (a request that asked for logprobs) the tokens are detokenized one at a time, so that each token's
end in the text is known: :meth:`settled_tokens` says how many tokens the text handed out accounts for, which keeps
a request's logprobs in step with its text, up to a stop string included.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Optional

from .detokenize import IncrementalDetokenizer


class TextStream:
    def __init__(self, decode, stops: list[str], track: bool = False):
        self.detok = IncrementalDetokenizer(decode)
        self.stops = list(stops)
        self.text = ""                      # settled text so far (before any stop string)
        self.sent = 0                       # characters handed out
        self.stopped = False
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.ends: Optional[list] = [] if track else None     # per token: len(text) once it was in (before a stop)

    @property
    def tokens(self) -> list:
        return self.detok.ids

    def start(self, i: int) -> int:
        """Where token ``i``'s text begins (``track`` only)."""
        return self.ends[i - 1] if i else 0

    def settled_tokens(self, final: bool) -> int:
        """How many tokens the text handed out so far accounts for (``track`` only): at the end every token; after
        a stop string the fewest whose text holds the text sent (a token cut by the stop string counts, those after
        it do not); mid-stream those whose text is all sent (a token that adds no text, such as a skipped special
        token or the first bytes of a character, waits for the next one that does)."""
        if final and not self.stopped:
            return len(self.ends)
        if self.sent == 0:
            return 0
        i = bisect_left(self.ends, self.sent)       # the first token whose text reaches the end of what was sent
        return i + 1 if self.stopped or self.ends[i] == self.sent else i

    def push(self, tokens: list, final: bool = False) -> str:
        """Add tokens; the newly settled text ('' when none). ``final``: the completion ended, flush everything."""
        if self.stopped:
            return ""
        old = len(self.text)
        if self.ends is None:
            self.text += self.detok.push(tokens) if tokens else ""
        else:
            for token in tokens:
                self.text += self.detok.push([token])
                self.ends.append(len(self.text))
        if final:
            self.text += self.detok.flush()
            if self.ends:
                self.ends[-1] = len(self.text)      # what the flush settled ends with the last token
        for stop in self.stops:
            at = self.text.find(stop, max(0, old - len(stop) + 1))
            if at != -1:
                self.stopped = True
                self.text = self.text[:at]
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self._hold)
        new = self.text[self.sent:end]
        self.sent = end
        return new
