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


_PATCH_BUILTIN_SOURCE = '''def _patch_builtin(pkg, builder, scope: _LangPatchScope):
    for name, member in inspect.getmembers(pkg):
        if tl.core.is_builtin(member):
            _patch_attr(pkg, name, member, builder, scope)
'''


def _quicker_interpreter_patching() -> None:
    """Triton's interpreter re-patches triton.language at every launch and at every call of a ``@triton.jit`` helper
    inside a kernel (``_patch_lang``), each time listing the members of tl, tl.core, tl.tensor, tl.math and
    tl.core.tensor_descriptor_base with ``inspect.getmembers`` to find the builtins: about 0.5 ms a call, some 40 %
    of the interpreter time of the kernel tests. The same patching, in the same order, from the builtins' names
    listed once here (before anything is patched): the interpreter runs the same code on the same values. Only
    for the ``_patch_builtin`` this was written against (another Triton: left as it is)."""
    import inspect

    try:
        import triton.language as tl
        from triton.runtime import interpreter
        original = interpreter._patch_builtin
        if inspect.getsource(original) != _PATCH_BUILTIN_SOURCE:
            return
        pkgs = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    except Exception:            # no triton, or another layout of its interpreter
        return
    names = {pkg: [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)] for pkg in pkgs}

    def _patch_builtin(pkg, builder, scope):
        if pkg not in names:
            return original(pkg, builder, scope)
        for name in names[pkg]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = _patch_builtin


def pytest_configure(config):
    if not (torch.cuda.is_available() and _runs_gpu_tests(config.option.markexpr or "")):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        _quicker_interpreter_patching()
    workers = getattr(config, "workerinput", {}).get("workercount")
    if workers:
        # an xdist worker (the default run's -n 2): its share of the cores as torch threads. With each worker on
        # torch's default (every core), -n 2 on 2 cores runs 4 OpenMP threads on 2 cores, whose spin-waits made the
        # small-tensor tests (exactness sampling, tiny models) several times slower
        share = max(1, _cores() // int(workers))
        torch.set_num_threads(share)
        # and the processes tests spawn (a server's engine and API processes) start with the same share: on torch's
        # default they oversubscribed the cores beside the other worker, and a served test ran up to 30x slower
        os.environ["OMP_NUM_THREADS"] = str(share)


def pytest_addoption(parser):
    parser.addoption("--soak-json", default=None, help="where the GPU soak test keeps its record")
    parser.addoption("--soak-args", default="--rounds 3", help="arguments for bench/scripts/soak.py in the GPU soak test")
