"""`python -m bench.scale` splits --total-s over its stages and hands what a stage leaves unused to the next ones."""
import argparse
import time

from bench import scale


def _args(tmp_path, stages, total):
    p = argparse.ArgumentParser()
    scale.add_arguments(p)
    return p.parse_args([*stages, "--res", str(tmp_path), "--total-s", str(total), "--device", "cpu"])


def test_budgets_split_in_proportion_and_carry_over(tmp_path, monkeypatch):
    seen = {}

    def fake_stage(stage, a, models, deadline, log=print):
        seen[stage] = deadline - time.time()
        if stage == "xsum-t0":
            time.sleep(0.2)   # ends early: most of its share is left for the others
        return {stage: "ok"}

    monkeypatch.setattr(scale, "run_stage", fake_stage)
    stages = ["xsum-t0", "cnndm-t0", "cnndm-t1"]
    total = 175.0   # = 65 + 50 + 60, the default budgets
    assert scale.run(_args(tmp_path, stages, total)) == 0
    assert abs(seen["xsum-t0"] - 65.0) < 1.0
    # cnndm-t0 gets its share of the ~174.8 s left, i.e. more than its default 50 s
    assert seen["cnndm-t0"] > 50.0 + 20.0
    assert abs(seen["cnndm-t0"] - (total - 0.2) * 50 / 110) < 1.0
    assert seen["cnndm-t1"] > 60.0


def test_a_stage_starts_only_with_ten_seconds_left(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(scale, "run_stage", lambda stage, *a, **k: ran.append(stage) or {stage: "ok"})
    assert scale.run(_args(tmp_path, ["xsum-t0", "cnndm-t0"], 12.0)) == 0   # 6.8 s: skipped; cnndm-t0 gets 12 s
    assert ran == ["cnndm-t0"]
    assert scale.run(_args(tmp_path, ["xsum-t0", "cnndm-t0"], 9.0)) == 0   # nothing gets 10 s
    assert ran == ["cnndm-t0"]


def test_stage_order_does_not_matter_for_the_draft_model(tmp_path):
    """drafters first (context drafters, no draft model) then studies-text (the 0.5B draft) in one process."""
    loaded = []

    class Recorder(scale.Models):
        def _load(self, cfg):
            loaded.append(cfg.draft)
            return "target", "draft-model", "proc", cfg.draft

    models = Recorder(False, "cpu", drafts={"summarization": "small-draft", "asr": "asr-draft"})
    from tilespec.bench.config import EvalConfig
    assert models.get(EvalConfig(device="cpu", draft="ngram")) == ("target", "ngram", "proc")
    assert models.get(EvalConfig(device="cpu", draft="small-draft")) == ("target", "draft-model", "proc")
    assert loaded == ["small-draft"]


def test_runs_finished_earlier_take_no_share_of_a_resumed_stage(tmp_path, monkeypatch):
    """A resumed stage whose other runs are done gives its whole budget to the run still to finish (a share computed
    over runs that were already complete once lost two n-gram resumes)."""
    from tilespec.bench import quality as run_mod

    a = _args(tmp_path, ["drafters"], 100.0)
    runs = scale.runs_of("drafters", a)
    assert len(runs) >= 2
    first = runs[0][1]                                        # runs after it are done: they must not dilute it
    monkeypatch.setattr(run_mod, "find_run", lambda path, cfg: None if (cfg.dataset, cfg.draft) == (
        first["dataset"], first["draft"]) else {"n": 1, "stages_done": list(cfg.studies)})
    budgets = []

    def fake_evaluate(cfg, **kw):
        budgets.append(cfg.time_budget)
        return {"n": 1, "n_requested": 1, "stages_done": []}

    monkeypatch.setattr(run_mod, "evaluate", fake_evaluate)
    monkeypatch.setattr(run_mod, "write_results", lambda path, rec: None)
    status = scale.run_stage("drafters", a, models=type("M", (), {"get": lambda self, cfg: None})(),
                             deadline=time.time() + 100.0, log=lambda *x: None)
    assert len(budgets) == 1 and budgets[0] > 95.0            # all of the ~100 s, not 100 / len(runs)
    assert sum(v == "done earlier" for v in status.values()) == len(runs) - 1
