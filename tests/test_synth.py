"""The synthetic espeak-ng ASR set through the shared-library backend (``espeakng-loader``; no binary needed), CPU."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench import synth, synth_espeak
from tilespec.datasets import load_synthetic

ROWS = [dict(id="1", reference="The cat sat on the mat all day long."),
        dict(id="2", reference="Rain is expected across the north of England tomorrow.")]
FIELDS = {"id", "path", "transcript", "voice", "speed", "source", "sample_rate", "duration_s", "kind"}


def _need_library():
    pytest.importorskip("espeakng_loader", reason="espeakng-loader not installed (pip install 'tilespec[asr-synth]')")


def test_backend_choice(monkeypatch):
    monkeypatch.setattr(synth.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="backend must be one of"):
        synth.espeak_backend("nope")
    with pytest.raises(RuntimeError, match="espeak-ng is not installed"):
        synth.espeak_backend("binary")
    monkeypatch.setattr(synth_espeak, "available", lambda: False)
    with pytest.raises(RuntimeError, match="asr-synth"):
        synth.espeak_backend()
    assert not synth.espeak_available()
    monkeypatch.setattr(synth_espeak, "available", lambda: True)
    assert synth.espeak_backend() == "library"
    monkeypatch.setattr(synth.shutil, "which", lambda name: "/usr/bin/espeak-ng")
    assert synth.espeak_backend("library") == "library" and synth.espeak_backend() == "binary"


def test_library_backend_writes_two_clips(tmp_path):
    _need_library()
    fmt = "flac"
    try:
        import soundfile  # noqa: F401
    except ImportError:
        fmt = "wav"
    meta = synth.make_synthetic(tmp_path, n=2, seed=0, rows=ROWS, min_words=5, max_words=25, fmt=fmt,
                                backend="library", log=None)
    assert meta["backend"] == "library" and meta["espeak_ng"] and meta["n"] == 2
    assert meta["library_sample_rate"] > 16000 and set(meta["voice_map"]) == set(synth.VOICES)
    entries = [json.loads(line) for line in (tmp_path / "manifest.jsonl").read_text().splitlines()]
    assert len(entries) == 2 and {e["transcript"] for e in entries} == {r["reference"] for r in ROWS}
    for e in entries:
        assert FIELDS <= set(e) and e["kind"] == synth.KIND and e["sample_rate"] == 16000
        assert e["voice"] in synth.VOICES and e["speed"] in synth.SPEEDS and e["source"].startswith("xsum:")
        audio, sr = synth.read_audio(tmp_path / e["path"])
        assert sr == 16000 and audio.ndim == 1
        assert abs(len(audio) / sr - e["duration_s"]) < 2e-3 and e["duration_s"] > 1.0
        assert float(np.sqrt(np.mean(audio ** 2))) > 0.01 and float(np.abs(audio).max()) > 0.1  # not silent
    clips = load_synthetic(None, folder=tmp_path)          # the library reads what the repository's maker wrote
    assert [c["reference"] for c in clips] == [e["transcript"] for e in entries]
    assert all(c["kind"] == synth.KIND and c["audio"].dtype == np.float32 for c in clips)


def test_library_voices_resolve_and_missing_voice_is_clear(tmp_path):
    _need_library()
    lib = synth_espeak.library()
    for voice in synth.VOICES:
        assert lib.resolve(voice)
    assert lib.resolve("en-us+f3").endswith("+f3")
    with pytest.raises(RuntimeError, match="not installed.*English voices"):
        lib.resolve("xx-nowhere")
    with pytest.raises(RuntimeError, match="variant 'nope'"):
        lib.resolve("en-us+nope")
    with pytest.raises(RuntimeError, match="xx-nowhere"):
        synth.make_synthetic(tmp_path / "set", n=1, rows=ROWS, voices=("xx-nowhere",), fmt="wav",
                             backend="library", log=None)
    assert not (tmp_path / "set").exists()
    pcm, rate = lib.synth("Hello there.", "en-gb", 175)
    assert rate == lib.sample_rate and pcm.dtype == np.int16 and pcm.size > rate // 4
