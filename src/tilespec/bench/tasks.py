"""Task adapters: how examples become decoder inputs, how tokens become text, and how texts are scored.

``TextTask`` (summarization): prompt ``"<article> Summary:"``, token ids from the tokenizer, ROUGE-1 vs the
reference summaries. ``AsrTask``: log-mel features from the Whisper feature extractor, the decoder prefix
(``<|startoftranscript|>[<|en|><|transcribe|>]<|notimestamps|>``), WER with Whisper's English normaliser.
Both accept duck-typed tokenizers so that tests can run them on tiny random models without downloads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tilespec.datasets import summarization_prompt
from .metrics import rouge1, wer


@dataclass
class Prepared:
    """One decoder input: prompt token ids and, for encoder-decoder models, encoder features [1, mels, frames]."""

    ids: list
    features: Optional[torch.Tensor] = None


class TextTask:
    """Summarization: ``tokenizer`` needs ``__call__(text).input_ids`` (or ``encode``) and ``decode``."""

    name = "summarization"
    metric = "rouge1"
    higher_is_better = True

    def __init__(self, tokenizer, max_article_chars: Optional[int] = 4000):
        if tokenizer is None:
            raise ValueError("summarization needs a tokenizer")
        self.tokenizer, self.max_article_chars = tokenizer, max_article_chars

    def prepare(self, example: dict, device, dtype) -> Prepared:
        if "document" not in example:
            raise ValueError(f"summarization example {example.get('id')!r} has no 'document'")
        prompt = summarization_prompt(example["document"], self.max_article_chars)
        enc = self.tokenizer(prompt)
        ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc.input_ids
        return Prepared(ids=list(ids))

    def decode(self, tokens: list) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def score(self, texts: list, examples: list) -> float:
        return rouge1(texts, [e.get("references") or e["reference"] for e in examples])


class AsrTask:
    """ASR with a Whisper processor (``feature_extractor`` + ``tokenizer``) or any object offering the same calls."""

    name = "asr"
    metric = "wer"
    higher_is_better = False

    def __init__(self, processor, multilingual: bool = False, prefix: Optional[list] = None):
        if processor is None:
            raise ValueError("ASR needs a Whisper processor (feature extractor + tokenizer)")
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        if prefix is None:
            names = (["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"] if multilingual
                     else ["<|startoftranscript|>", "<|notimestamps|>"])
            prefix = [int(i) for i in self.tokenizer.convert_tokens_to_ids(names)]
        self.prefix = list(prefix)

    def prepare(self, example: dict, device, dtype) -> Prepared:
        if "audio" not in example:
            raise ValueError(f"ASR example {example.get('id')!r} has no 'audio'")
        fe = getattr(self.processor, "feature_extractor", self.processor)
        feats = fe(example["audio"], sampling_rate=16000, return_tensors="pt")
        feats = feats["input_features"] if hasattr(feats, "keys") else feats
        return Prepared(ids=list(self.prefix), features=feats.to(device=device, dtype=dtype))

    def decode(self, tokens: list) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True).strip()

    def score(self, texts: list, examples: list) -> float:
        return wer(texts, [e["reference"] for e in examples])


def make_task(task: str, processor, target=None, max_article_chars: Optional[int] = 4000):
    """The adapter for ``task`` ("summarization" | "asr") around ``processor`` (tokenizer / Whisper processor)."""
    if task == "summarization":
        return TextTask(processor, max_article_chars)
    if task == "asr":
        multi = bool(getattr(getattr(target, "generation_config", None), "is_multilingual", False))
        return AsrTask(processor, multilingual=multi)
    raise ValueError(f"unknown task {task!r}; choose summarization or asr")
