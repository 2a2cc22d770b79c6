"""The registry of verification methods: one :class:`Method` record per method, the one list everyone iterates.

A method is one module under ``tilespec.verify.methods`` that registers ``fn(inputs: VerifyInputs, **options) ->
VerifyResult`` with :func:`register_method`. The record says what the engine, the evaluation, the benchmarks and the
report need to know: whether the output law equals the target's (``exact``; the exactness suite holds every exact
method to that), whether its device work never syncs with the host (``graph_safe``: the engine may replay it as a
CUDA graph), whether it needs Triton, its options with their defaults, and whether the evaluation runs it by default.
A method honours the whole contract (ragged K_b, seeds, SamplingParams) or raises NotImplementedError naming what it
does not support. Options are resolved to a sorted tuple of (name, value) pairs, hashable, so they can key a graph.

``keyed_draws``: the method draws its resampled / bonus tokens by the keyed two-level inverse CDF of
:func:`tilespec.verify.rng.inverse_cdf` (one uniform keyed by (seed, position, SAMPLE)), like ``reference``. For a
step without drafts (K = 0: the target's own next token) every such method makes the same draw, so the engine
samples those steps with :func:`no_draft_method` (``fused`` on a GPU: two launches, logits in, no probability
tensor) whatever method verifies its drafts -- the token is the same up to float rounding at a CDF boundary.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from tilespec.env import triton_available

from .types import VerifyInputs, VerifyResult

MethodFn = Callable[..., VerifyResult]
Options = tuple   # ((name, value), ...) sorted by name


@dataclass(frozen=True)
class Method:
    name: str
    fn: MethodFn
    exact: bool
    description: str
    graph_safe: bool = False
    needs_triton: bool = False
    options: Options = field(default=())
    evaluate: bool = True
    check_options: Optional[Callable[..., None]] = None
    batch_invariant: bool = True   # a request's tokens never depend on the rest of the batch (keyed randomness)
    keyed_draws: bool = False      # resampled / bonus tokens by the keyed inverse CDF (see the module docstring)

    def resolve_options(self, options: Optional[Mapping] = None) -> Options:
        """Defaults overridden by ``options`` -> sorted ((name, value), ...); unknown names raise ValueError."""
        given = dict(options or {})
        defaults = dict(self.options)
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            known = ", ".join(defaults) or "none"
            raise ValueError(f"method {self.name!r} has no option(s) {unknown}; its options: {known}")
        merged = {**defaults, **{k: type(defaults[k])(v) for k, v in given.items()}}
        if self.check_options is not None:
            self.check_options(**merged)
        return tuple(sorted(merged.items()))

    def __call__(self, inputs: VerifyInputs, options: Optional[Mapping] = None) -> VerifyResult:
        if self.needs_triton and not triton_available():
            raise ImportError(f"method {self.name!r} needs Triton; install it (pip install 'tilespec[gpu]')")
        return self.fn(inputs, **dict(self.resolve_options(options)))


_METHODS: dict[str, Method] = {}
_BUILTINS_LOADED = False


def register_method(name: str, *, exact: bool, description: str, graph_safe: bool = False,
                    needs_triton: bool = False, options: Optional[Mapping] = None, evaluate: bool = True,
                    check_options: Optional[Callable[..., None]] = None,
                    batch_invariant: bool = True, keyed_draws: bool = False) -> Callable[[MethodFn], MethodFn]:
    """Decorator: ``@register_method("reference", exact=True, description=..., graph_safe=True)``.
    ``batch_invariant=False`` marks a method whose random numbers come from one stream for the whole batch
    (per-request seeds are then refused)."""
    def wrap(fn: MethodFn) -> MethodFn:
        _METHODS[name] = Method(name=name, fn=fn, exact=exact, description=description, graph_safe=graph_safe,
                                needs_triton=needs_triton, options=tuple(sorted((options or {}).items())),
                                evaluate=evaluate, check_options=check_options, batch_invariant=batch_invariant,
                                keyed_draws=keyed_draws)
        return fn
    return wrap


def _load_builtins() -> None:
    """Import every module of ``tilespec.verify.methods`` (they import Triton lazily, inside their functions)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    from . import methods
    for info in pkgutil.iter_modules(methods.__path__):
        importlib.import_module(f"{methods.__name__}.{info.name}")
    _BUILTINS_LOADED = True


def get_method(name: str) -> Method:
    """The record of ``name``; unknown names raise ValueError listing the available ones."""
    if name not in _METHODS:
        _load_builtins()
    if name not in _METHODS:
        close = difflib.get_close_matches(str(name), available_methods(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown verification method {name!r}; {hint}available: {', '.join(available_methods())} "
                         f"(or {AUTO!r}: fused on a GPU, else reference)")
    return _METHODS[name]


AUTO = "auto"


def resolve_method(name: str, device) -> str:
    """``"auto"`` -> the fastest exact method on ``device`` (``fused`` on a GPU with Triton, else ``reference``);
    any other name as it is (checked by :func:`get_method` where it is used)."""
    if name != AUTO:
        return name
    return "fused" if _fused_sampler_on(device) else "reference"


def no_draft_method(name: str, device) -> str:
    """The method that samples a step without drafts (K = 0) for a decoder verifying with ``name`` on ``device``:
    ``fused`` on a CUDA device with Triton when ``name`` makes keyed draws (``reference``, ``coupled``, ``tiled``,
    ``fused``: the same uniform and the same rule, see the module docstring), ``name`` otherwise (on the CPU every
    method samples its own K = 0 steps; ``hf`` draws from a torch generator; ``sigmoid`` is not exact)."""
    return "fused" if get_method(name).keyed_draws and _fused_sampler_on(device) else name


def _fused_sampler_on(device) -> bool:
    """Whether steps without drafts on ``device`` sample with ``fused`` (a GPU with Triton; the CPU's interpreter
    would be slower than PyTorch)."""
    return getattr(device, "type", device) == "cuda" and triton_available()


def all_methods() -> list[Method]:
    """Every registered method record, built-in ones first in the order of :data:`ORDER`, then the others by name."""
    _load_builtins()
    rank = {n: i for i, n in enumerate(ORDER)}
    return sorted(_METHODS.values(), key=lambda m: (rank.get(m.name, len(ORDER)), m.name))


def available_methods() -> list[str]:
    """Names of the methods that can be requested."""
    _load_builtins()
    return sorted(_METHODS)


# Display order in tables and benchmark listings (baseline first, then the exact methods, the non-exact last).
ORDER = ("hf", "reference", "tiled", "fused", "sigmoid")
