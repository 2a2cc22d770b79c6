"""`tilespec eval scale` splits --total-s over its stages and hands what a stage leaves unused to the next ones."""
import argparse
import time

from tilespec.eval import scale


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
    from tilespec.eval.config import EvalConfig
    assert models.get(EvalConfig(device="cpu", draft="ngram")) == ("target", "ngram", "proc")
    assert models.get(EvalConfig(device="cpu", draft="small-draft")) == ("target", "draft-model", "proc")
    assert loaded == ["small-draft"]
