"""Test-session setup. Triton kernels run under its interpreter unless the run selects the ``gpu`` tests on a
machine with CUDA: the CPU tiers pass CPU tensors to the kernels (as on CI), also on a GPU machine. The variable must
be set before any module imports triton, so it is set in ``pytest_configure``, before test modules are collected
(xdist workers run it too, with the same marker expression)."""
import os

import torch

# fixtures every test module may name without importing them: one_thread, home, fake_entry
pytest_plugins = ["shared_fixtures"]


def _runs_gpu_tests(markexpr: str) -> bool:
    words = markexpr.replace("(", " ").replace(")", " ").split()
    return any(w == "gpu" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def pytest_configure(config):
    if not (torch.cuda.is_available() and _runs_gpu_tests(config.option.markexpr or "")):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        # an xdist worker (the default run's -n 2): its share of the cores as torch threads. With each worker on
        # torch's default (every core), -n 2 on 2 cores runs 4 OpenMP threads on 2 cores, whose spin-waits made the
        # small-tensor tests (exactness sampling, tiny models) several times slower
        torch.set_num_threads(max(1, _cores() // int(workers)))


def pytest_addoption(parser):
    parser.addoption("--soak-json", default=None, help="where the GPU soak test keeps its record")
    parser.addoption("--soak-args", default="--rounds 3", help="arguments for bench/scripts/soak.py in the GPU soak test")
