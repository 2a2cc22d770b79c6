"""Training speech for the distilled Whisper draft never holds an evaluation clip: the LJSpeech split, the synthetic
training set made of XSum article sentences with the evaluation transcripts excluded (CPU, no model)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench import synth
from tilespec.datasets import LJSPEECH_EVAL_CLIPS, ljspeech_split
from tilespec.training.whisper_training import training_speech

EVAL_TEXT = "The cat sat on the mat all day long."


def _wavs(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        synth.write_wav(folder / name, np.zeros(1600, dtype=np.float32) + 0.1, 16000)


def _set(folder, texts):
    _wavs(folder / "clips", [f"c{i}.wav" for i in range(len(texts))])
    (folder / "manifest.jsonl").write_text("".join(json.dumps({"id": f"c{i}", "path": f"clips/c{i}.wav",
                                                               "transcript": t}) + "\n" for i, t in enumerate(texts)))


def test_training_speech_drops_every_evaluation_clip(tmp_path, monkeypatch):
    names = [f"LJ001-{i:04d}.wav" for i in range(1, 21)]
    _wavs(tmp_path / "data" / "ljspeech" / "wavs", names)
    _set(tmp_path / "eval-set", [EVAL_TEXT, "Something else entirely was said here."])
    _set(tmp_path / "train-set", [EVAL_TEXT.upper(), "Rain is expected across the north of England tomorrow."])
    monkeypatch.setenv("TILESPEC_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("TILESPEC_SYNTH_DIR", str(tmp_path / "eval-set"))
    monkeypatch.setenv("TILESPEC_HOME", str(tmp_path / "home"))
    evaluation, train = ljspeech_split()
    assert [p.name for p in evaluation] == names[:LJSPEECH_EVAL_CLIPS] and [p.name for p in train] == names[16:]
    rows, data = training_speech([tmp_path / "data" / "ljspeech" / "wavs", tmp_path / "train-set"], log=None)
    assert sorted(r["id"] for r in rows) == sorted(names[16:] + ["train-set/c1"])
    assert [s["dropped_as_evaluation"] for s in data["sources"]] == [1, 16]
    rows, _ = training_speech(None, log=None)            # default: the LJSpeech training clips
    assert sorted(r["id"] for r in rows) == names[16:]
    with pytest.raises(FileNotFoundError, match="no training speech"):
        training_speech([tmp_path / "data" / "ljspeech" / "wavs" / names[0]], log=None)


def test_article_sentences_skip_the_evaluation_transcripts(tmp_path):
    rows = [dict(id="7", document="First sentence is here. Second one follows it! A third? Yes.", reference="x")]
    assert [r["id"] for r in synth.document_sentences(rows)] == ["7.s0", "7.s1", "7.s2", "7.s3"]
    _set(tmp_path / "eval", [EVAL_TEXT])
    exclude = synth.excluded_texts([tmp_path / "eval"])
    assert exclude == {EVAL_TEXT.lower()}
    pool = [dict(id="1", reference=EVAL_TEXT), dict(id="2", reference="Rain is expected in the north tomorrow.")]
    pytest.importorskip("espeakng_loader", reason="espeakng-loader not installed (pip install 'tilespec[asr-synth]')")
    meta = synth.make_synthetic(tmp_path / "train", n=1, rows=pool, exclude=exclude, fmt="wav", backend="library",
                                log=None, source="test sentences", prefix="test")
    entry = json.loads((tmp_path / "train" / "manifest.jsonl").read_text())
    assert entry["transcript"] == pool[1]["reference"] and entry["source"] == "test:2"
    assert meta["excluded_sentences"] == 1 and meta["source"] == "test sentences"
