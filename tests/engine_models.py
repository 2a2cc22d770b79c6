"""Tiny random Hugging Face models for the engine tests (fp32, CPU, a few ms per forward)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM


def tiny_config(family: str = "llama", vocab: int = 128, layers: int = 2, hidden: int = 64):
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family]
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               attn_implementation="sdpa", tie_word_embeddings=False)


def tiny_lm(seed: int, family: str = "llama", vocab: int = 128, layers: int = 2, logit_scale: float = 1.0):
    """A random causal LM; ``logit_scale`` multiplies the LM head so next-token laws are far from uniform."""
    torch.manual_seed(seed)
    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[family]
    model = cls(tiny_config(family, vocab, layers)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def no_eos_lm():
    """tiny_lm(0) with sharp next-token laws and no EOS (requests run to max_tokens): the engine tests' target."""
    torch.set_num_threads(1)
    model = tiny_lm(0, logit_scale=3.0)
    model.generation_config.eos_token_id = None
    return model


def random_prompts(n: int, seed: int, length: int = 8, vocab: int = 64) -> list:
    """``n`` token lists of ``length`` ids in [1, vocab), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (length,), generator=g).tolist() for _ in range(n)]


def layer_skip(model, layers: int):
    """A draft that keeps the first ``layers`` decoder layers of ``model`` (weights copied): agrees often."""
    cfg = model.config.to_dict()
    cfg["num_hidden_layers"] = layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    draft = type(model)(type(model.config)(**cfg)).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


def tiny_whisper(seed: int, decoder_layers: int = 2, vocab: int = 96):
    """A random Whisper (mels 16, 32 input frames) with a sharpened LM head."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=decoder_layers,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_source_positions=16, max_target_positions=128,
                        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                        attn_implementation="sdpa", suppress_tokens=[], begin_suppress_tokens=[])
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        model.proj_out.weight.mul_(20.0)
    return model


def whisper_layer_skip(model, layers: int):
    """Draft with the first ``layers`` decoder layers and the same encoder (weights copied)."""
    cfg = model.config.to_dict()
    cfg["decoder_layers"] = layers
    draft = type(model)(type(model.config)(**cfg)).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


def stub_whisper_io(monkeypatch, target):
    """Replace audio feature extraction and the decoder prompt with fixed stand-ins for ``target`` (a tiny Whisper),
    and return a processor whose ``decode`` joins ids: ``tilespec.transcribe`` then runs on raw sample arrays."""
    from tilespec.models import whisper
    mels, frames = target.config.num_mel_bins, 2 * target.config.max_source_positions
    monkeypatch.setattr(whisper, "features", lambda proc, audios, device, dtype: torch.randn(
        len(audios), mels, frames, generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(whisper, "decoder_prompt", lambda model, proc, language="en": [1])

    class Proc:
        eos_token_id, pad_token_id = None, 0

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    return Proc()


def exact_sequence_law(model, sampling, prompt: list, vocab: int, length: int):
    """P(x_1..x_length | prompt) of ``model`` under ``sampling`` for every sequence over ``vocab`` tokens, in
    lexicographic order (a flat numpy array), by full forwards of every prefix."""
    import itertools

    import numpy as np

    from tilespec.verify.distributions import log_probs
    from tilespec.verify.validation import resolve_sampling

    resolved = resolve_sampling(sampling, 1, "cpu")
    probs = np.ones([vocab] * length)
    with torch.no_grad():
        for depth in range(length):
            for prefix in itertools.product(range(vocab), repeat=depth):
                logits = model(torch.tensor([list(prompt) + list(prefix)])).logits[:, -1:].float()
                p = torch.exp(log_probs(logits, resolved))[0, 0].double().numpy()
                probs[prefix] *= p.reshape([vocab] + [1] * (length - depth - 1))
    return probs.ravel()


def serve_in_two_waves(engine, reqs) -> list:
    """Half the requests, two steps, the rest; step until idle, the pool checked after every step: every request's
    tokens, once every block is back."""
    for r in reqs[:len(reqs) // 2]:
        engine.submit(r)
    engine.step()
    engine.step()
    for r in reqs[len(reqs) // 2:]:
        engine.submit(r)
    while engine.has_work:
        engine.step()
        engine.blocks.check()
    assert engine.blocks.num_free == engine.blocks.num_blocks - 1        # every block back
    return [r.tokens for r in reqs]


def tree_models() -> tuple:
    """(target, draft model, head) for the token-tree entry-point tests: a sharp tiny Llama target without EOS, a
    layer-skip draft model of it and a random head bound to it (its drafts are poor, but every accept and reject path
    is exact whatever the head proposes)."""
    from tilespec.heads import DraftHead, config_for
    torch.manual_seed(0)
    target = tiny_lm(0, logit_scale=20.0)
    target.generation_config.eos_token_id = None
    head = DraftHead(config_for(target, draft_vocab=128))
    head.bind(target).eval().requires_grad_(False)
    return target, layer_skip(target, 1), head
