"""The server's incremental detokenizer (serve/detokenize.py) against full decoding: random token ids -- which split
multi-byte UTF-8 characters anywhere -- pushed in random chunks give, piece by piece, exactly the tokenizer's decode of
all of them, for a byte-level BPE (GPT-2 / Qwen style) and a byte-fallback BPE with SentencePiece's leading-space
rule (Llama style), through the Rust fast path and through ``tokenizer.decode``; and the stop-string stream built on
it. One limit is inherent: byte-fallback decoding turns a whole run of byte tokens into U+FFFD when any byte of the run
is invalid, so a later invalid byte rewrites text already streamed; on such garbage no stream can equal the full
decode, and the byte-fallback case compares valid text only (any split of its characters into byte tokens)."""
from __future__ import annotations

import random

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from tilespec.serve.detokenize import IncrementalDetokenizer, fast_decoder  # noqa: E402
from tilespec.serve.text import TextStream  # noqa: E402

CORPUS = ["héllo wörld, naïve café", "中文字符和标点。", "emoji 🙂🚀 and ✓ marks", "plain ascii text here",
          "Ελληνικά και русский", "tabs\tand\nnewlines  double  spaces"] * 20


def byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


def byte_fallback() -> PreTrainedTokenizerFast:
    """Llama-style: '▁' for spaces, <0xNN> byte tokens for what the vocabulary lacks, the first space stripped."""
    vocab = {"<unk>": 0, "<eos>": 1}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "é", "ö", "▁a", "▁b", "ab", "▁ab", "中", "文"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def spelled(tok, rng: random.Random) -> list:
    """Random text of the corpus's characters, each written as its vocabulary piece or as its UTF-8 byte tokens."""
    chars = sorted(set("".join(CORPUS)) - {" "})
    ids = []
    for _ in range(rng.randrange(1, 30)):
        ch = rng.choice(chars)
        piece = tok.convert_tokens_to_ids(ch)
        if piece != tok.unk_token_id and rng.random() < 0.5:
            ids.append(piece)
        else:
            ids += tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in ch.encode()])
    return ids


def pieces(decode, ids: list, rng: random.Random) -> list:
    detok, out, i = IncrementalDetokenizer(decode), [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 7])
        out.append(detok.push(ids[i:i + n]))
        i += n
    out.append(detok.flush())
    return out


@pytest.mark.parametrize("make", [byte_level, byte_fallback])
@pytest.mark.parametrize("path", ["rust", "decode"])
def test_random_ids_in_random_chunks_decode_as_a_whole(make, path):
    tok = make()
    decode = fast_decoder(tok) if path == "rust" else (lambda ids: tok.decode(ids, skip_special_tokens=True))
    rng = random.Random(0)
    vocab = len(tok)
    text_ids = [tok(s, add_special_tokens=False).input_ids for s in CORPUS[:6]]
    for trial in range(300):
        if trial % 3 == 0:      # real text, with an EOS somewhere
            ids = list(rng.choice(text_ids))
            ids.insert(rng.randrange(len(ids) + 1), tok.eos_token_id)
        elif make is byte_fallback:     # valid text whose characters are split into byte tokens at random
            ids = spelled(tok, rng)
        else:                   # anything: byte tokens that split characters, invalid bytes, specials
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        got = pieces(decode, ids, rng)
        assert "".join(got) == tok.decode(ids, skip_special_tokens=True), (trial, ids)


def test_fast_path_is_the_rust_decoder_and_waits_inside_characters():
    tok = byte_level()
    assert fast_decoder(tok)([tok.eos_token_id]) == ""
    raw = tok.backend_tokenizer.model          # the emoji's four byte-level pieces, one token each
    emoji = [raw.token_to_id(c) for c in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("🙂")[0][0]]
    assert None not in emoji and len(emoji) == 4
    detok = IncrementalDetokenizer(fast_decoder(tok))
    assert [detok.push([t]) for t in emoji] == ["", "", "", "🙂"]


def test_text_stream_holds_a_possible_stop_and_cuts_before_it():
    tok = byte_level()
    ids = tok("plain ascii text here", add_special_tokens=False).input_ids
    stream = TextStream(fast_decoder(tok), ["text"])
    out = "".join(stream.push([t]) for t in ids)
    assert stream.stopped and out == "plain ascii "
    whole = TextStream(fast_decoder(tok), [])
    assert "".join(whole.push([t]) for t in ids) + whole.push([], final=True) == "plain ascii text here"
