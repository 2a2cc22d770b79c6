"""Whisper inputs: audio files -> 16 kHz mono samples -> log-mel features, and the forced decoder prompt.

``decoder_prompt`` is <|startoftranscript|><|lang|><|transcribe|><|notimestamps|> for multilingual models and
<|startoftranscript|><|notimestamps|> for ``.en`` models (plain transcription, no timestamps). ``features`` returns
[B, mels, frames] on the requested device and dtype, ready for ``SpeculativeDecoder.generate(input_features=...)``.
"""
from __future__ import annotations

from pathlib import Path

SAMPLE_RATE = 16000


def load_audio(path):
    """numpy array of mono float32 samples at 16 kHz (any rate soundfile reads is resampled with a polyphase filter)."""
    from math import gcd

    import numpy as np
    import soundfile as sf
    from scipy.signal import resample_poly
    if not Path(path).is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    if Path(path).stat().st_size == 0:
        raise ValueError(f"audio file {path} is empty (0 bytes): give a recording")
    try:
        data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    except sf.SoundFileError as err:
        raise ValueError(f"{path} is not an audio file soundfile can read ({err}): give WAV/FLAC/OGG, or convert "
                         f"it, e.g. `ffmpeg -i {path} -ar 16000 out.wav`") from None
    if data.shape[0] == 0:
        raise ValueError(f"audio file {path} holds no samples: give a non-empty recording")
    mono = data.mean(axis=1)
    if rate != SAMPLE_RATE:
        g = gcd(int(rate), SAMPLE_RATE)
        mono = resample_poly(mono, SAMPLE_RATE // g, int(rate) // g).astype(np.float32)
    return mono


def decoder_prompt(model, processor, language: str = "en") -> list[int]:
    """The forced decoder prefix token ids for plain transcription without timestamps."""
    gc = model.generation_config
    sot = gc.decoder_start_token_id
    no_ts = getattr(gc, "no_timestamps_token_id", None)
    tokenizer = getattr(processor, "tokenizer", processor)
    if no_ts is None:
        no_ts = tokenizer.convert_tokens_to_ids("<|notimestamps|>")
    if getattr(gc, "is_multilingual", False):
        lang_ids = getattr(gc, "lang_to_id", {}) or {}
        key = f"<|{language}|>"
        if key not in lang_ids:
            raise ValueError(f"unknown language {language!r} for this Whisper model; use a code such as 'en'")
        task = (getattr(gc, "task_to_id", {}) or {}).get("transcribe")
        return [sot, lang_ids[key], task, no_ts]
    return [sot, no_ts]


def features(processor, audios, device, dtype):
    """Log-mel input features [B, mels, frames] of 16 kHz sample arrays."""
    extractor = getattr(processor, "feature_extractor", processor)
    feats = extractor(list(audios), sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    return feats.to(device=device, dtype=dtype)
