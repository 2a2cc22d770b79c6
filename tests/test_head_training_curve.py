"""bench/scripts/head_training_curve.py on CPU: its argument parsing and its grid on a tiny random target (a few
seconds: tiny budgets, so the points train few or no steps), the JSON it writes and its resume."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from engine_models import tiny_lm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def curve():
    path = ROOT / "bench" / "scripts" / "head_training_curve.py"
    spec = importlib.util.spec_from_file_location("head_training_curve", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["head_training_curve"] = module
    spec.loader.exec_module(module)
    return module


def test_arguments(curve):
    args = curve.parse(["--real-dir", "/m", "--minutes", "3.5,10", "--prompts", "500,2000", "--tv-weight", "0,0.5",
                        "--sample-temperatures", "0,1;0,0.7,1", "--out", "x.json"])
    assert args.minutes == [3.5, 10.0] and args.prompts == [500, 2000] and args.tv_weight == [0.0, 0.5]
    assert args.sample_temperatures == [(0.0, 1.0), (0.0, 0.7, 1.0)] and args.real_dir == "/m" and args.ignore_eos
    with pytest.raises(SystemExit):
        curve.parse(["--sample-temperatures", "0,-1", "--out", "x.json"])


def test_grid_on_a_tiny_target_writes_and_resumes(curve, tmp_path):
    torch.set_num_threads(1)
    target = tiny_lm(0, "qwen2", vocab=64, layers=2, logit_scale=3.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (6,), generator=g).tolist() for _ in range(8)]
    settings = {"max_new_tokens": 8, "gen_batch": 4, "seq_len": 16, "draft_vocab": 40, "ttt_steps": 2,
                "compile": False, "eval_every": 0, "max_steps": 2}
    grid = {"minutes": [0.01], "prompts": [4, 8], "tv_weight": [0.0, 0.5], "sample_temperatures": [(0.0, 1.0)]}
    out = tmp_path / "curve.json"
    doc = curve.run_curve(target, None, prompts, target_name="tiny", grid=grid, out=out, settings=settings,
                          record={"dtype": "torch.float32"}, log=lambda m: None)
    saved = json.loads(out.read_text())
    assert saved["target"] == "tiny" and saved["dtype"] == "torch.float32" and len(saved["results"]) == 4
    env = saved["environment"]
    assert {"device", "torch", "transformers", "commit", "date"} <= set(env)
    for row in saved["results"]:
        assert set(row["alpha_by_temperature"]) == {"0", "0.7", "1"} and len(row["alpha_per_step"]) == 2
        assert all(0 <= a <= 1 for alphas in row["alpha_by_temperature"].values() for a in alphas)
        assert row["tau_by_temperature"]["1"]["2"] >= 1 and row["responses"] <= row["prompts"]
    assert [r["key"] for r in doc["results"]] == [r["key"] for r in saved["results"]]
    grid["tv_weight"] = [0.0, 0.5, 1.0]                   # a rerun trains only the points the file lacks
    doc = curve.run_curve(target, None, prompts, target_name="tiny", grid=grid, out=out, settings=settings,
                          log=lambda m: None)
    assert len(doc["results"]) == 6 and doc["results"][:4] == saved["results"]
    with pytest.raises(ValueError, match="9 prompts asked for"):
        curve.run_curve(target, None, prompts, target_name="tiny", grid=dict(grid, prompts=[9]), out=out,
                        settings=settings, log=lambda m: None)
