"""Tiny random models for a CPU dry run of the paper-scale evaluation (``python -m bench.scale --tiny``).

Nothing here is a measurement: the models are random (a 2-layer Qwen2 target with a 1-layer layer-skip draft over a
128-token vocabulary; a 2+2-layer Whisper with 16 mel bins and 32 input frames), the tokenizers are word-level toys.
They exist so that the driver (bench/gpu/run.sh eval), the stage runner (.scale), batching, chunked writes and
resume can be exercised end to end on a CPU in minutes, with the real data loaders.
"""
from __future__ import annotations

import numpy as np
import torch


class ToyTokenizer:
    """Word-level tokenizer over ids 3..127 (``w3``..``w127``); prompts cut to ``max_tokens`` words."""

    def __init__(self, max_tokens: int = 48):
        self.max_tokens = max_tokens

    def __call__(self, text):
        return {"input_ids": [3 + (sum(map(ord, w)) % 120) for w in text.split()][:self.max_tokens] or [3]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{int(i)}" for i in ids if int(i) >= 3)

    def convert_tokens_to_ids(self, names):
        return [1] + [3] * (len(names) - 1)          # Whisper's decoder prefix: start token, then plain tokens


class ToyProcessor:
    """Stands in for a Whisper processor: 16 mel bins x 32 frames resized from the audio."""

    def __init__(self):
        self.tokenizer = ToyTokenizer()

    def feature_extractor(self, audio, sampling_rate, return_tensors):
        x = np.resize(np.asarray(audio, dtype=np.float32), 16 * 32).reshape(1, 16, 32)
        return {"input_features": torch.as_tensor(x)}


def _layer_skip(model, layers: int, key: str):
    cfg = model.config.to_dict()
    cfg[key] = layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    draft = type(model)(type(model.config)(**cfg)).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


def tiny_text_pair(device: str = "cpu", dtype=torch.float32):
    """(target, layer-skip draft, toy tokenizer): random Qwen2, 2 layers, vocab 128, sharpened LM head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, attn_implementation="sdpa", eos_token_id=2, bos_token_id=1)
    target = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)
    draft = _layer_skip(target, 1, "num_hidden_layers")
    return target.to(device, dtype), draft.to(device, dtype), ToyTokenizer()


def tiny_whisper_pair(device: str = "cpu", dtype=torch.float32):
    """(target, layer-skip draft sharing nothing, toy processor): random Whisper, 2+2 layers, vocab 96."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=96, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_source_positions=16, max_target_positions=128,
                        decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
                        attn_implementation="sdpa", suppress_tokens=[], begin_suppress_tokens=[])
    target = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        target.proj_out.weight.mul_(20.0)
    draft = _layer_skip(target, 1, "decoder_layers")
    return target.to(device, dtype), draft.to(device, dtype), ToyProcessor()
