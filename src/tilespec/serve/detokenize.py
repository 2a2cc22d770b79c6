"""Incremental detokenization: new token ids -> the new text, without re-decoding the whole completion.

The window method (as TGI and vLLM use for tokenizers without a streaming decoder): keep ``prefix`` and ``read``
offsets into the ids; the new text is ``decode(ids[prefix:])`` minus ``decode(ids[prefix:read])``, and after each
emission the window moves to start at the previous ``read``. Decoding the previous piece with the new tokens keeps
what depends on neighbours right (a leading-space rule of SentencePiece, byte pieces that merge into one character);
a window always starts where an emission ended, on a character boundary, because a run of byte-fallback tokens
that starts inside a character decodes to nothing but U+FFFD. While the tail decodes to an incomplete UTF-8 sequence
(U+FFFD at the end: byte-fallback or byte-level tokens split inside a character) nothing is handed out and the
offsets stay, so the next tokens complete it. ``flush`` at the end hands out whatever is left, as a full decode would.

Cost per push: two decodes of a window of the last two pieces, through the Rust tokenizer where there is one (a
Hugging Face fast tokenizer without ``clean_up_tokenization_spaces``, which is a Python pass over the whole text),
else the tokenizer's own ``decode``.
"""
from __future__ import annotations


def fast_decoder(tokenizer):
    """(ids -> text) with special tokens skipped: the Rust backend's decode where it equals ``tokenizer.decode``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, decode):
        self.decode = decode
        self.ids: list = []
        self.prefix = 0
        self.read = 0

    def push(self, ids: list) -> str:
        """Add ``ids``; the text they settle ('' while it ends inside a character)."""
        self.ids += ids
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def flush(self) -> str:
        """Everything not handed out yet (the end of the completion)."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(before):]
