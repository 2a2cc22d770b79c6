"""Text prompts -> token ids, the one way every entry point does it (``SpeculativeDecoder(prompts=...)``,
``tilespec.generate``, the CLI, the end-to-end benchmark).

The rule: with ``chat=True`` (the default) and a tokenizer that has a chat template (instruct models), a prompt is
one user turn wrapped by ``apply_chat_template(..., add_generation_prompt=True)`` and tokenized without adding
special tokens again (the template holds them); otherwise the raw text is tokenized with the tokenizer's special
tokens. ``chat=False`` keeps raw text for every tokenizer.
"""
from __future__ import annotations


def uses_chat_template(tok, chat: bool = True) -> bool:
    return bool(chat and getattr(tok, "chat_template", None))


def chat_prompt(tok, text: str, chat: bool = True) -> str:
    """``text`` as one user turn of the tokenizer's chat template, when it has one and ``chat`` is on."""
    if uses_chat_template(tok, chat):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return text


def check_texts(texts) -> list[str]:
    """``texts`` (a str or a list of str) as a list; TypeError for anything else, ValueError for no prompts or an
    empty / whitespace-only one (the chat template alone is not a prompt: the CLI refuses ``--prompt ""`` too)."""
    if isinstance(texts, str):
        texts = [texts]
    elif isinstance(texts, (list, tuple)):
        texts = list(texts)
    else:
        raise TypeError(f"prompts must be a str or a list of str, got {type(texts).__name__}")
    if not texts:
        raise ValueError("no prompts: give at least one")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"prompt {i} must be a str, got {type(t).__name__}")
        if not t.strip():
            raise ValueError(f"prompt {i} is empty: give some text to continue")
    return texts


def encode_prompts(tok, texts, chat: bool = True) -> list[list[int]]:
    """Token id lists of ``texts`` (a str or a list of str, checked by :func:`check_texts`) under the rule in the
    module docstring."""
    texts = check_texts(texts)
    special = not uses_chat_template(tok, chat)
    return [list(tok(chat_prompt(tok, t, chat), add_special_tokens=special).input_ids) for t in texts]


def prompt_lists(tok, input_ids=None, prompts=None, chat: bool = True) -> list[list[int]]:
    """Exactly one of ``input_ids`` (token lists, one list, or an integer tensor [B, L] / [L]) and ``prompts``
    (str or list of str, encoded by :func:`encode_prompts`, needs ``tok``) -> token id lists."""
    import torch

    if (input_ids is None) == (prompts is None):
        raise ValueError("pass exactly one of input_ids and prompts")
    if prompts is not None:
        if tok is None:
            raise ValueError("string prompts need a tokenizer (SpeculativeDecoder(..., tokenizer=...))")
        return encode_prompts(tok, prompts, chat)
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim == 1:
            input_ids = input_ids[None]
        if input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be an integer tensor [B, L], got {tuple(input_ids.shape)}")
        return input_ids.tolist()
    lists = list(input_ids)
    if lists and isinstance(lists[0], int):
        lists = [lists]
    return [list(map(int, p)) for p in lists]
