"""Direct launches of the verification kernels: call the CompiledKernel Triton returned for a launch plan instead of
going through the JIT dispatcher (argument binding, specialisation and cache-key hashing on every call).

Used by :mod:`tilespec.verify.kernels.launch` (per plan) and the keep-threshold kernels (:func:`launch`); see
:class:`_Launcher` for when a direct call is safe.
"""
from __future__ import annotations


import torch

from tilespec import settings
from tilespec.env import triton_interpreted

_INTERPRET = triton_interpreted()


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class _Launcher:
    """``kernel[grid](*args, **consts)``, or - on CUDA, for a cached plan - the compiled kernel called directly.

    Triton's JIT dispatcher re-derives the specialisation of every argument (dtype, 16-byte alignment, integer
    width) and hashes a cache key on every launch, several us of host time for our ~35-argument kernels. A plan
    fixes every constexpr, and the wrappers pass tensors whose dtypes are fixed by the plan and the logits' dtype,
    so the only other inputs to Triton's specialisation are the pointers' 16-byte alignment and whether an integer
    fits in 32 bits. ``__call__`` therefore keeps, per plan, the CompiledKernel the first (JIT) launch returned for
    (tensor dtypes), and calls it directly afterwards when every user tensor is 16-byte aligned and every stride
    fits in 32 bits (anything else goes through the JIT path, which is always correct). If the installed Triton
    rejects the direct call (its calling convention differs between versions), the launcher falls back to the JIT
    path for good, with a warning. On by default on CUDA; ``TILESPEC_DIRECT_LAUNCH=0`` (:mod:`tilespec.settings`)
    disables it.
    """

    def __init__(self, name: str, fn):
        self.name, self.fn = name, fn
        self.mode = "full"          # "full": constexprs passed too; "plain": runtime args only; "off": JIT only
        self.const_names = None

    def __call__(self, plan, grid, args: tuple, consts: dict, key) -> None:
        cache = plan.direct
        if cache is None or key is None or self.mode == "off":
            self.fn[grid](*args, **consts)
            return
        key = (self.name, key)
        kernel = cache.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, **consts)
            if hasattr(kernel, "function") and not _capturing(args[0].device):
                cache[key] = kernel
            return
        try:
            if self.mode == "full":
                if self.const_names is None:
                    self.const_names = list(self.fn.arg_names[len(args):])
                kernel[grid](*args, *[consts[n] for n in self.const_names])
            else:
                kernel[grid](*args)
        except (TypeError, ValueError, IndexError, KeyError) as err:
            self.mode = "plain" if self.mode == "full" else "off"
            if self.mode == "off":
                import warnings
                warnings.warn(f"tilespec: direct launch of {self.name} failed ({err!r}); using Triton's JIT "
                              f"dispatcher from now on", RuntimeWarning)
            self(plan, grid, args, consts, key[1])


# Direct launches (see _Launcher) are on by default: the exactness suite at 1e6 samples ran through them with Triton 3.6
# (bench/results/exactness-gpu-h200.json).
_DIRECT = not _INTERPRET and settings.get().direct_launch
_LAUNCHERS: dict = {}
_ALIGN_MASK = 15
_INT32_MAX = 2**31 - 1


def _launcher(fn) -> _Launcher:
    """The launcher of kernel ``fn`` (looked up at call time, so tests can replace a kernel by a stub)."""
    launcher = _LAUNCHERS.get(id(fn))
    if launcher is None or launcher.fn is not fn:
        launcher = _LAUNCHERS[id(fn)] = _Launcher(getattr(fn, "__name__", type(fn).__name__), fn)
    return launcher


def _direct_key(plan, device: torch.device, tensors: tuple, ints: tuple):
    """The tensors' dtypes when a direct launch is safe for them and these integers, else None (see _Launcher)."""
    if plan.direct is None or not _DIRECT or device.type != "cuda" or device.index != torch.cuda.current_device():
        return None
    ptr = 0
    for t in tensors:
        ptr |= t.data_ptr()
    if ptr & _ALIGN_MASK or max(ints) > _INT32_MAX:
        return None
    return tuple(t.dtype for t in tensors)


class _Shared:
    """The compiled-kernel cache of :func:`launch` (a plan-like holder for :class:`_Launcher`)."""
    direct: dict = {}


SHARED_LIMIT = 4096   # signatures kept by launch(); later ones take the JIT path (still correct)


def launch(kernel, grid: tuple, tensors: tuple, ints: tuple, consts: dict) -> None:
    """``kernel[grid](*tensors, *ints, **consts)`` through :class:`_Launcher`: after the first (JIT) launch of a
    signature - the tensors' dtypes, every integer and constexpr value, all pointers 16-byte aligned - the compiled
    kernel is called directly. ``grid`` is a 3-tuple; integers that Triton specialises on (1, multiples of 16) are
    part of the key, so a cached kernel is only reused for the same values."""
    device = tensors[0].device
    launcher, key = _launcher(kernel), None
    if _DIRECT and device.type == "cuda" and device.index == torch.cuda.current_device():
        ptr = 0
        for t in tensors:
            ptr |= t.data_ptr()
        if not ptr & _ALIGN_MASK and max(ints, default=0) <= _INT32_MAX:
            key = (tuple(t.dtype for t in tensors), ints, tuple(sorted(consts.items())))
            if len(_Shared.direct) >= SHARED_LIMIT and (launcher.name, key) not in _Shared.direct:
                key = None
    launcher(_Shared, grid, (*tensors, *ints), consts, key)
