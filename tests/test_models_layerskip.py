"""Layer-skip self-speculative drafts: weight sharing, N = all reproduces the target, N < all is the truncated
computation (first N layers + final norm + head), KV-cache stepping and, for Whisper, a shared encoder output."""
from __future__ import annotations

import pytest
import torch

from tilespec.models.cache_keyword import cache_kwarg, output_cache
from tilespec.models import layer_skip_draft, num_decoder_layers, shares_weights


def _qwen(layers=4):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(
        vocab_size=90, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=4, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=10,
        max_target_positions=16, pad_token_id=88, bos_token_id=88, eos_token_id=88, decoder_start_token_id=89)).eval()


@torch.no_grad()
def test_causal_lm_full_depth_equals_target_and_shares_weights():
    t = _qwen()
    ids = torch.randint(0, 97, (2, 7))
    d = layer_skip_draft(t, 4)
    assert torch.equal(d(ids).logits, t(ids).logits)
    d2 = layer_skip_draft(t, 2)
    assert shares_weights(d2, t) and d2.lm_head is t.lm_head and d2.model.layers[1] is t.model.layers[1]
    assert num_decoder_layers(d2) == 2 and num_decoder_layers(t) == 4
    n_target = sum(p.numel() for p in t.parameters())
    n_draft = sum(p.numel() for p in d2.parameters())
    assert n_draft < n_target


@torch.no_grad()
def test_causal_lm_truncated_computation_and_cache():
    from transformers import DynamicCache
    t = _qwen()
    ids = torch.randint(0, 97, (2, 7))
    d = layer_skip_draft(t, 2)
    hidden = t(ids, output_hidden_states=True).hidden_states[2]          # output of layer index 1
    assert torch.allclose(d(ids).logits, t.lm_head(t.model.norm(hidden)), atol=1e-6)
    full = d(ids).logits
    kw = cache_kwarg(d)                 # the current keyword: our calls print no deprecation warning
    out = d(ids[:, :4], use_cache=True, **{kw: DynamicCache(config=d.config)})
    step = d(ids[:, 4:], use_cache=True, **{kw: output_cache(out)})
    assert torch.allclose(step.logits, full[:, 4:], atol=1e-5)
    assert output_cache(out).get_seq_length() == 7
    g = d.generate(ids, max_new_tokens=3, do_sample=False)
    assert g.shape == (2, 10)


@torch.no_grad()
def test_whisper_draft_shares_encoder_output_and_truncates_decoder():
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache
    t = _whisper()
    feats = torch.randn(1, 8, 20)
    dec = torch.tensor([[89, 3, 4, 5, 6]])
    enc = t.model.encoder(feats)
    full = layer_skip_draft(t, 4)
    assert full.model.encoder is t.model.encoder
    assert torch.equal(full(encoder_outputs=enc, decoder_input_ids=dec).logits,
                       t(encoder_outputs=enc, decoder_input_ids=dec).logits)
    d = layer_skip_draft(t, 1)
    ref = t(encoder_outputs=enc, decoder_input_ids=dec, output_hidden_states=True)
    want = t.proj_out(t.model.decoder.layer_norm(ref.decoder_hidden_states[1]))
    got = d(encoder_outputs=enc, decoder_input_ids=dec).logits
    assert torch.allclose(got, want, atol=1e-6)
    cache = EncoderDecoderCache(DynamicCache(config=d.config), DynamicCache(config=d.config))
    kw = cache_kwarg(d)
    o1 = d(encoder_outputs=enc, decoder_input_ids=dec[:, :3], use_cache=True, **{kw: cache})
    o2 = d(encoder_outputs=enc, decoder_input_ids=dec[:, 3:], use_cache=True, **{kw: output_cache(o1)})
    assert torch.allclose(o2.logits, got[:, 3:], atol=1e-5)
    assert d.generate(input_features=feats, max_new_tokens=3).shape[1] >= 2


def test_bad_layer_counts_and_models():
    t = _qwen(layers=3)
    for bad in (0, 4, -1, 2.0, True):
        with pytest.raises(ValueError, match="layers"):
            layer_skip_draft(t, bad)
    with pytest.raises(ValueError, match="not a supported target"):
        layer_skip_draft(torch.nn.Linear(2, 2), 1)
