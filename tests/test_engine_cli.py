"""CLI plumbing of generate / demo / bench e2e with tiny random models (model loading is patched)."""
from __future__ import annotations

import json

import pytest
import torch

from tilespec.cli import main

from engine_models import layer_skip, tiny_lm

@pytest.fixture(autouse=True)
def paged_on_cpu(monkeypatch):
    """"auto" takes the paged engine on CUDA only (api.paged_by_default); here the rest of its rule runs on CPU."""
    monkeypatch.setattr("tilespec.api.paged_by_default", lambda target: True)



class ToyTokenizer:
    """Characters <-> ids (vocab 128), enough for the CLI paths."""

    chat_template = None
    eos_token_id = 2
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": [1] + [3 + (ord(c) % 120) for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids if i > 2)


@pytest.fixture
def tiny_pair(monkeypatch):
    torch.set_num_threads(1)
    target = tiny_lm(0, logit_scale=20.0)
    target.generation_config.eos_token_id = None
    draft = layer_skip(target, 1)
    import tilespec.cli.generate as gen
    monkeypatch.setattr(gen, "load_pair", lambda t, d, device, dtype, log=None: (target, draft if d else None,
                                                                              ToyTokenizer()))
    import tilespec.cli.demo as demo
    monkeypatch.setattr(demo, "load_pair", gen.load_pair)
    return target, draft


def test_generate_streams_and_writes_json(tiny_pair, tmp_path, capsys):
    out = tmp_path / "g.json"
    rc = main(["generate", "--target", "t", "--draft", "t:layers=1", "--prompt", "hello", "--max-new-tokens", "12",
               "--gamma-schedule", "heuristic", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert len(data["tokens"][0]) == 12 and data["stats"]["new_tokens"] == 12
    assert data["outputs"][0] in capsys.readouterr().out


def test_generate_batch_file(tiny_pair, tmp_path):
    batch = tmp_path / "prompts.txt"
    batch.write_text("one\ntwo two\n\nthree three three\n")
    out = tmp_path / "g.json"
    assert main(["generate", "--target", "t", "--draft", "t:layers=1", "--batch-file", str(batch),
                 "--max-new-tokens", "6", "--temperature", "0.7", "--top-k", "20", "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["tokens"]) == 3


def test_generate_errors(tiny_pair, tmp_path, capsys):
    assert main(["generate", "--target", "t"]) == 1
    assert "--prompt" in capsys.readouterr().err
    assert main(["generate", "--target", "t", "--batch-file", str(tmp_path / "missing.txt")]) == 1
    with pytest.raises(SystemExit) as exit_:   # a bad number is a usage error: argparse names the flag, status 2
        main(["generate", "--target", "t", "--prompt", "x", "--gamma", "0"])
    assert exit_.value.code == 2 and "argument --gamma: must be an integer >= 1" in capsys.readouterr().err


def test_generate_picks_its_engine(tiny_pair, tmp_path, capsys, monkeypatch):
    """--engine auto (default): the paged engine for a Llama-family pair, the decoder for what only it does (here
    a γ schedule); greedy tokens equal on both; --engine paged refuses a decoder-only option before any model
    loads."""
    runs = {}
    for name, extra in [("auto", []), ("decoder", ["--engine", "decoder"]), ("paged", ["--engine", "paged"]),
                        ("schedule", ["--gamma-schedule", "heuristic"])]:
        out = tmp_path / f"{name}.json"
        assert main(["generate", "--target", "t", "--draft", "t:layers=1", "--prompt", "hello", "--max-new-tokens",
                     "8", "--gamma", "3", "--json", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert [runs[n]["engine"] for n in runs] == ["paged", "decoder", "paged", "decoder"]
    assert runs["auto"]["stats"]["runtime"] == "paged" and runs["decoder"]["stats"]["runtime"] == "eager"
    assert len({str(r["tokens"]) for r in runs.values()}) == 1 and len(runs["auto"]["tokens"][0]) == 8
    capsys.readouterr()
    import tilespec.cli.generate as gen

    def no_load(*a, **kw):
        raise AssertionError("loaded before the engine check")
    monkeypatch.setattr(gen, "load_pair", no_load)
    assert main(["generate", "--target", "t", "--prompt", "x", "--engine", "paged", "--gamma-schedule", "optimal"]) == 1
    assert "the paged engine cannot honour gamma_schedule; use --engine decoder" in capsys.readouterr().err


def test_generate_runs_token_trees_on_the_paged_engine(tiny_pair, tmp_path, capsys, monkeypatch):
    """--tree with a context drafter: --engine paged verifies the trees there, with the decoder's greedy tokens;
    a draft model's --chains have no paged runner: --engine paged refuses them naming the fix."""
    import tilespec.cli.generate as gen
    target, draft = tiny_pair
    monkeypatch.setattr(gen, "load_pair", lambda t, d, device, dtype, log=None: (
        target, d if d == "ngram" else draft, ToyTokenizer()))
    runs = {}
    for engine in ("paged", "decoder"):
        out = tmp_path / f"{engine}.json"
        assert main(["generate", "--target", "t", "--draft", "ngram", "--prompt", "abab abab", "--max-new-tokens",
                     "8", "--tree", "8", "--tree-branch", "2", "--tree-depth", "3", "--engine", engine,
                     "--json", str(out)]) == 0
        runs[engine] = json.loads(out.read_text())
    assert runs["paged"]["engine"] == "paged" and runs["paged"]["stats"]["runtime"] == "paged"
    assert runs["paged"]["tokens"] == runs["decoder"]["tokens"] and runs["paged"]["stats"]["drafted"] > 0
    assert main(["generate", "--target", "t", "--draft", "t:layers=1", "--prompt", "x", "--chains", "2,2",
                 "--engine", "paged"]) == 1
    err = capsys.readouterr().err
    assert "drafts a token tree the paged engine has no runner for" in err and "use --engine decoder" in err


@pytest.mark.parametrize("engine", ["auto", "decoder"])
def test_demo_checks_greedy_equality(tiny_pair, capsys, engine):
    assert main(["demo", "--max-new-tokens", "10", "--layers", "1", "--repeats", "3", "--engine", engine]) == 0
    err = capsys.readouterr().err
    assert "equals the target's greedy output" in err
    assert f"engine: {'paged' if engine == 'auto' else 'decoder'}" in err


def test_bench_e2e_smoke(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--tiny", "--num-prompts", "2", "--batch-sizes", "1,2", "--temperatures", "0",
                 "--max-new-tokens", "6", "--methods", "reference", "--modes", "hf,hf-assisted,ar,tilespec",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    systems = {r["system"] for r in data["results"]}
    assert {"hf", "hf-assisted", "ar", "tilespec:reference/g5"} <= systems
    spec = [r for r in data["results"] if r["kind"] == "tilespec"]
    assert all(r["greedy_match_ar"] == 1.0 for r in spec)
    assert data["environment"]["torch"] == torch.__version__


def test_bench_e2e_warmup_covers_all_batches_and_schedule_gamma(tmp_path, monkeypatch):
    """Each timed batch runs right after its warm-up runs (same seeds); adaptive γ predicts with round(mean γ)."""
    from tilespec.engine import SpeculativeDecoder
    torch.set_num_threads(1)
    calls = []
    orig = SpeculativeDecoder.generate

    def spy(self, prompts, *a, **kw):
        calls.append((len(prompts), kw.get("seed")))
        return orig(self, prompts, *a, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--tiny", "--num-prompts", "3", "--batch-sizes", "2", "--temperatures", "0",
                 "--max-new-tokens", "6", "--methods", "reference", "--gamma-schedule", "heuristic",
                 "--warmup", "2", "--modes", "ar,tilespec", "--out", str(out)]) == 0
    # per engine config, per batch ([2, 1]): 2 warm-up runs, then the timed run, all with seeds 1000*i
    per_config = [(2, 0)] * 3 + [(1, 1000)] * 3
    assert len(calls) % len(per_config) == 0 and calls[:len(per_config)] == per_config
    data = json.loads(out.read_text())
    spec = [r for r in data["results"] if r["kind"] == "tilespec"]
    assert spec and all(r["predicted_speedup_gamma"] == max(1, round(r["mean_gamma"])) for r in spec)


def test_demo_answer_check_parses_the_answer_back():
    import json as _json

    from tilespec.cli.demo import DEFAULT_PROMPT, DOCUMENT, answer_check
    assert answer_check(DEFAULT_PROMPT, _json.dumps(DOCUMENT, indent=2)) == "yes"
    assert answer_check(DEFAULT_PROMPT, "```json\n" + _json.dumps(DOCUMENT, indent=2) + "\n```") == "yes"
    assert answer_check(DEFAULT_PROMPT, _json.dumps(dict(DOCUMENT, version="0.4.0"), indent=2)) == "no"
    assert answer_check(DEFAULT_PROMPT, '{\n  "name": "tilespec",') == "no"          # cut short: not JSON
    assert answer_check("another prompt", "{}") is None                             # only the default task is checked
