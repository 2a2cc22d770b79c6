"""Convert a CTranslate2 Whisper model (``WhisperSpec``, fp16/fp32) into a transformers
``WhisperForConditionalGeneration`` folder (safetensors, config, generation config, tokenizer, feature extractor).

Name mapping (CT2 -> HF, HF names under ``model.``; see the project spec, Appendix A):

* ``{encoder,decoder}/position_encodings/encodings`` -> ``{encoder,decoder}.embed_positions.weight``;
  ``encoder/conv{1,2}`` -> ``encoder.conv{1,2}``; ``decoder/embeddings/weight`` -> ``decoder.embed_tokens.weight``
  (``proj_out`` is tied to it);
* ``*/layer_i/self_attention/linear_0`` is fused ``[q; k; v]`` (rows 3*d) -> ``self_attn.{q,k,v}_proj`` (the k bias
  is zero and dropped); ``linear_1`` -> ``self_attn.out_proj``; ``layer_norm`` -> ``self_attn_layer_norm``;
* decoder cross-attention ``attention/linear_0`` -> ``encoder_attn.q_proj``, ``linear_1`` fused ``[k; v]`` ->
  ``encoder_attn.{k,v}_proj``, ``linear_2`` -> ``encoder_attn.out_proj``, ``layer_norm`` -> ``encoder_attn_layer_norm``;
* ``ffn/linear_0`` -> ``fc1``, ``ffn/linear_1`` -> ``fc2``, ``ffn/layer_norm`` -> ``final_layer_norm``;
* ``{encoder,decoder}/layer_norm`` -> ``{encoder,decoder}.layer_norm``; ``gamma``/``beta`` -> ``weight``/``bias``.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from .ct2 import CT2Model, read_ct2

ENGLISH_VOCAB = 51864


def _ln(v: dict, src: str, dst: str, out: dict) -> None:
    out[f"{dst}.weight"] = v[f"{src}/gamma"]
    out[f"{dst}.bias"] = v[f"{src}/beta"]


def _lin(v: dict, src: str, dst: str, out: dict) -> None:
    out[f"{dst}.weight"] = v[f"{src}/weight"]
    if f"{src}/bias" in v:
        out[f"{dst}.bias"] = v[f"{src}/bias"]


def _split(v: dict, src: str, dsts: list[str | None], out: dict) -> None:
    """Split fused rows of ``src`` evenly into ``dsts``; ``None`` drops a piece, a name ending in '!' drops its bias."""
    w = v[f"{src}/weight"]
    b = v.get(f"{src}/bias")
    n = w.shape[0] // len(dsts)
    for i, dst in enumerate(dsts):
        nobias = dst.endswith("!")
        dst = dst.rstrip("!")
        out[f"{dst}.weight"] = w[i * n:(i + 1) * n]
        if b is not None and not nobias:
            out[f"{dst}.bias"] = b[i * n:(i + 1) * n]


def _num_layers(v: dict, side: str) -> int:
    ids = {int(m.group(1)) for k in v if (m := re.match(rf"{side}/layer_(\d+)/", k))}
    if ids != set(range(len(ids))):
        raise ValueError(f"CT2 {side} layers are not numbered 0..n-1: {sorted(ids)}")
    return len(ids)


def ct2_to_hf_state_dict(ct2: CT2Model) -> tuple[dict[str, np.ndarray], dict]:
    """Map CT2 variables to HF parameter names; returns (state dict without ``proj_out``, config kwargs)."""
    if ct2.spec != "WhisperSpec":
        raise ValueError(f"expected a CTranslate2 WhisperSpec model, got spec {ct2.spec!r}")
    v = ct2.variables
    out: dict[str, np.ndarray] = {}
    for side in ("encoder", "decoder"):
        out[f"model.{side}.embed_positions.weight"] = v[f"{side}/position_encodings/encodings"]
        _ln(v, f"{side}/layer_norm", f"model.{side}.layer_norm", out)
        for i in range(_num_layers(v, side)):
            s, d = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            _split(v, f"{s}/self_attention/linear_0", [f"{d}.self_attn.q_proj", f"{d}.self_attn.k_proj!",
                                                       f"{d}.self_attn.v_proj"], out)
            _lin(v, f"{s}/self_attention/linear_1", f"{d}.self_attn.out_proj", out)
            _ln(v, f"{s}/self_attention/layer_norm", f"{d}.self_attn_layer_norm", out)
            if side == "decoder":
                _lin(v, f"{s}/attention/linear_0", f"{d}.encoder_attn.q_proj", out)
                _split(v, f"{s}/attention/linear_1", [f"{d}.encoder_attn.k_proj!", f"{d}.encoder_attn.v_proj"], out)
                _lin(v, f"{s}/attention/linear_2", f"{d}.encoder_attn.out_proj", out)
                _ln(v, f"{s}/attention/layer_norm", f"{d}.encoder_attn_layer_norm", out)
            _lin(v, f"{s}/ffn/linear_0", f"{d}.fc1", out)
            _lin(v, f"{s}/ffn/linear_1", f"{d}.fc2", out)
            _ln(v, f"{s}/ffn/layer_norm", f"{d}.final_layer_norm", out)
    for name in ("conv1", "conv2"):
        _lin(v, f"encoder/{name}", f"model.encoder.{name}", out)
    out["model.decoder.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    emb = v["decoder/embeddings/weight"]
    cfg = dict(
        vocab_size=int(emb.shape[0]), d_model=int(emb.shape[1]),
        num_mel_bins=int(v["encoder/conv1/weight"].shape[1]),
        encoder_layers=_num_layers(v, "encoder"), decoder_layers=_num_layers(v, "decoder"),
        encoder_attention_heads=int(v["encoder/num_heads"]), decoder_attention_heads=int(v["decoder/num_heads"]),
        encoder_ffn_dim=int(v["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(v["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(v["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(v["decoder/position_encodings/encodings"].shape[0]),
    )
    return out, cfg


def _special_ids(vocab: int) -> dict:
    """Whisper's fixed special-token ids: English-only models have vocab 51864, multilingual ones 51865+."""
    if vocab == ENGLISH_VOCAB:
        return dict(eos=50256, start=50257, prev=50360, notimestamps=50362, multilingual=False)
    if vocab < ENGLISH_VOCAB:     # synthetic test vocabularies: keep every special id inside the vocabulary
        return dict(eos=vocab - 2, start=vocab - 1, prev=vocab - 1, notimestamps=vocab - 1, multilingual=False)
    return dict(eos=50257, start=50258, prev=50361, notimestamps=50363, multilingual=True)


def convert_ct2_whisper(src: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.float16) -> Path:
    """Convert the CT2 Whisper folder ``src`` (``model.bin`` [+ ``config.json``, ``tokenizer.json``]) into ``out_dir``.

    Weights are saved in ``dtype`` (default fp16, the original precision). Tokenizer and feature extractor are
    written only when ``src/tokenizer.json`` exists. Returns ``out_dir``.
    """
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    src, out_dir = Path(src), Path(out_dir)
    ct2 = read_ct2(src)
    src_dir = src if src.is_dir() else src.parent
    sd, cfg_kw = ct2_to_hf_state_dict(ct2)
    ids = _special_ids(cfg_kw["vocab_size"])
    ct2_cfg = json.loads((src_dir / "config.json").read_text()) if (src_dir / "config.json").is_file() else {}
    suppress = list(ct2_cfg.get("suppress_ids", []))
    begin_suppress = list(ct2_cfg.get("suppress_ids_begin", [220, ids["eos"]]))
    config = WhisperConfig(
        **cfg_kw, pad_token_id=ids["eos"], bos_token_id=ids["eos"], eos_token_id=ids["eos"],
        decoder_start_token_id=ids["start"], suppress_tokens=suppress, begin_suppress_tokens=begin_suppress,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    tensors = {k: torch.from_numpy(np.array(a)).to(dtype) for k, a in sd.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [k for k in missing if k != "proj_out.weight"]
    if missing or unexpected:
        raise ValueError(f"CT2 -> HF Whisper mapping mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    model.model.encoder.embed_positions.weight.requires_grad_(False)

    tokenizer = None
    if (src_dir / "tokenizer.json").is_file():
        from transformers import WhisperTokenizerFast
        tokenizer = WhisperTokenizerFast(tokenizer_file=str(src_dir / "tokenizer.json"), pad_token="<|endoftext|>")
    gen = dict(
        decoder_start_token_id=ids["start"], bos_token_id=ids["eos"], eos_token_id=ids["eos"], pad_token_id=ids["eos"],
        no_timestamps_token_id=ids["notimestamps"], prev_sot_token_id=ids["prev"], is_multilingual=ids["multilingual"],
        suppress_tokens=suppress, begin_suppress_tokens=begin_suppress, max_length=config.max_target_positions,
        max_initial_timestamp_index=50, return_timestamps=False,
        alignment_heads=[list(x) for x in ct2_cfg.get("alignment_heads", [])],
    )
    if ids["multilingual"]:
        gen["task_to_id"] = {"translate": ids["start"] + 100, "transcribe": ids["start"] + 101}
        if tokenizer is not None and ct2_cfg.get("lang_ids"):
            gen["lang_to_id"] = {tokenizer.convert_ids_to_tokens(int(i)): int(i) for i in ct2_cfg["lang_ids"]}
    else:
        gen["forced_decoder_ids"] = None
    model.generation_config = GenerationConfig(**gen)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        from transformers import WhisperFeatureExtractor, WhisperProcessor
        fe = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
        WhisperProcessor(feature_extractor=fe, tokenizer=tokenizer).save_pretrained(out_dir)
    return out_dir
