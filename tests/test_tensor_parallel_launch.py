"""Tensor parallelism's launch on CPU: the checks that refuse a bad degree before any weight loads (heads from the
configuration alone, the GPU count), one failing or stalled rank ending every rank within a bounded time (forked
ranks over gloo, and a real ``torchrun`` launch), and the choice of the "best" all-reduce."""
from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from tilespec.engine.native import tp_launch
from tilespec.engine.native.tp_collectives import pick_faster, resolve_allreduce
from tilespec.engine.native.tp_launch import check_target, init_tensor_parallel, run_rank, target_config


def _config_folder(tmp_path, heads=8, kv=4, width=96):
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=width, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv)
    cfg.save_pretrained(tmp_path)
    return tmp_path


def _launched(monkeypatch, world: int, rank: int = 0):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))


def test_target_config_reads_the_folder_alone(tmp_path, monkeypatch):
    folder = _config_folder(tmp_path)
    cfg = target_config(str(folder))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 4)
    assert target_config(str(tmp_path / "missing")) is None
    from tilespec.models import cache
    from tilespec.models.registry import REGISTRY
    monkeypatch.setattr(cache, "is_cached", lambda name: False)
    assert target_config(next(iter(REGISTRY))) is None         # not fetched yet: checked once loaded


def test_degree_checked_before_weights_load(tmp_path, monkeypatch):
    """load_pair (under generate --tp, tilespec.generate(tp=), bench e2e --tp) refuses a degree that does not divide
    the heads or the MLP width before models.load runs."""
    import tilespec.api as api
    from tilespec import models
    folder = str(_config_folder(tmp_path, heads=8, kv=4, width=96))
    loads = []

    def load(name, **kw):
        loads.append(name)
        raise RuntimeError("weights loaded")
    monkeypatch.setattr(models, "load", load)
    cpu = torch.device("cpu")
    for size, what in ((8, "key/value heads 4"), (3, "attention heads 8"), (64, "MLP width 96")):
        with pytest.raises(ValueError, match=f"degree {size} does not divide .*{what}.*choose a degree"):
            api.load_pair(folder, None, cpu, torch.float32, tp=SimpleNamespace(size=size, device=cpu))
    assert loads == []
    with pytest.raises(RuntimeError, match="weights loaded"):      # a dividing degree gets as far as the load
        api.load_pair(folder, None, cpu, torch.float32, tp=SimpleNamespace(size=4, device=cpu))
    assert loads == [folder]
    check_target(str(tmp_path / "not-a-model"), 8)     # nothing to read: the sharding checks the loaded model


def test_fewer_gpus_than_degree(monkeypatch):
    _launched(monkeypatch, world=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"needs 4 GPUs .* 2 are visible \(CUDA_VISIBLE_DEVICES=0,1\): pass --tp 2"):
        init_tensor_parallel(4)
    assert not torch.distributed.is_initialized()
    _launched(monkeypatch, world=2)
    with pytest.raises(ValueError, match="launcher started 2 processes"):     # world size before GPUs
        init_tensor_parallel(4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, timeout_s: float, stall: bool) -> None:
    """Rank 1 raises (or, ``stall``, sleeps without joining); every other rank waits for it in an all-reduce."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)

    def main():
        init_tensor_parallel(world, timeout_s=timeout_s)
        if rank == 1:
            if stall:
                time.sleep(120)
            raise ValueError("rank 1 fails on purpose")
        torch.distributed.all_reduce(torch.ones(1))
        time.sleep(120)          # not reached: the all-reduce fails
    run_rank(main)


def _run_ranks(world: int, timeout_s: float, stall: bool, bound_s: float) -> dict:
    """Exit codes of ranks != 1 (and of rank 1 unless stalled) after at most ``bound_s`` seconds."""
    ctx = multiprocessing.get_context("fork")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, timeout_s, stall)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + bound_s
    try:
        for r, p in enumerate(procs):
            if not (stall and r == 1):
                p.join(max(0.0, deadline - time.monotonic()))
        return {r: p.exitcode for r, p in enumerate(procs) if not (stall and r == 1)}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()


def test_one_failing_rank_ends_every_rank():
    start = time.monotonic()
    codes = _run_ranks(world=3, timeout_s=60.0, stall=False, bound_s=45.0)
    assert codes == {0: 1, 1: 1, 2: 1}, codes       # the peers saw rank 1's connection close, well before 60 s
    assert time.monotonic() - start < 45.0


def test_a_stalled_rank_ends_its_peers_at_the_timeout():
    start = time.monotonic()
    codes = _run_ranks(world=2, timeout_s=3.0, stall=True, bound_s=40.0)
    assert codes == {0: 1}, codes
    assert 3.0 <= time.monotonic() - start < 40.0


def test_run_rank_passes_results_and_clean_exits():
    assert run_rank(lambda: 7) == 7
    with pytest.raises(SystemExit):
        run_rank(lambda: sys.exit(0))


@pytest.mark.slow
def test_torchrun_stops_every_rank_when_one_raises(tmp_path):
    """An uncaught exception on one rank of a real torchrun launch: the rank logs and exits (the hook that
    init_tensor_parallel installs) and torchrun stops the rank waiting in a collective."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import time, torch, torch.distributed as dist
        from tilespec.engine.native.tp_launch import init_tensor_parallel
        tp = init_tensor_parallel(2)
        if tp.rank == 1:
            raise ValueError("rank 1 fails on purpose")
        dist.all_reduce(torch.ones(1))
        time.sleep(300)
    """))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert "[tilespec rank 1] failed" in done.stderr and "rank 1 fails on purpose" in done.stderr
    assert time.monotonic() - start < 240


def test_best_allreduce_choice(monkeypatch):
    monkeypatch.delenv("TILESPEC_TP_ALLREDUCE", raising=False)
    assert resolve_allreduce("best", torch.device("cpu")) == "nccl"      # nothing to choose from off CUDA
    assert resolve_allreduce("best", torch.device("cuda", 0)) == "best"
    monkeypatch.setenv("TILESPEC_TP_ALLREDUCE", "best")
    assert resolve_allreduce("auto", torch.device("cuda", 0)) == "best"
    assert pick_faster(nccl_us=19.0, symm_us=8.0) == "symm"
    assert pick_faster(nccl_us=8.0, symm_us=8.0) == "nccl"
    assert pick_faster(nccl_us=12.0, symm_us=float("inf")) == "nccl"     # symm failed to capture on some rank


def test_excepthook_installed_once():
    before = sys.excepthook
    try:
        tp_launch.end_rank_on_uncaught_exception()
        hook = sys.excepthook
        tp_launch.end_rank_on_uncaught_exception()
        assert sys.excepthook is hook is tp_launch._excepthook
    finally:
        sys.excepthook = before
