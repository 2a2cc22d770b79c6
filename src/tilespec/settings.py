"""Every setting tilespec reads from the environment, in one place, typed and validated.

Read settings with :func:`get` (``settings.get().run_ahead``); nothing else in tilespec reads a ``TILESPEC_*``
variable. The environment is parsed and checked the first time it is read and again only when one of the
variables below changes (tests set them with ``monkeypatch.setenv``); a bad value is a :class:`ValueError` that
names the variable, the value and what it accepts.

=========================== ======================= ==========================================================
variable                    default                 meaning
=========================== ======================= ==========================================================
``TILESPEC_HOME``           ``~/.cache/tilespec``   model cache, fetched wheels, derived data
``TILESPEC_DATA``           ``$TILESPEC_HOME/data`` evaluation data that no package index serves (CNN/DM, LJSpeech)
``TILESPEC_SYNTH_DIR``      unset                   the synthetic speech set (``manifest.jsonl`` + clips) of the
                                                    ASR evaluation
``TILESPEC_COMMIT``         unset                   the commit results JSON record (a copy of a working tree,
                                                    e.g. on a GPU machine, may carry a stale ``.git``)
``TILESPEC_RUN_AHEAD``      ``1``                   the decoder drafts the next step while the host checks the
                                                    current one (``0``: off; the same tokens either way)
``TILESPEC_NATIVE_KERNELS`` unset (the engine's     Triton decode kernels of the native engine, a comma list
                            default set)            (``""``: none, ``all``: every one)
``TILESPEC_SDPA``           ``""``                  SDPA back-ends of the native engine, a comma list of
                                                    ``math``, ``flash``, ``efficient``, ``cudnn`` (``""``:
                                                    PyTorch's choice)
``TILESPEC_DIRECT_LAUNCH``  ``1``                   verification kernels called through their compiled launcher
                                                    on CUDA (``0``: Triton's JIT dispatcher on every call)
``TILESPEC_TP_ALLREDUCE``   unset (``auto``)        tensor-parallel all-reduce for ``allreduce="auto"``:
                                                    ``symm`` (symmetric memory, CUDA), ``nccl`` or ``best``
                                                    (the faster of the two, timed per shape)
``TILESPEC_API_KEY``        unset                   the bearer token ``tilespec serve`` requires (``--api-key``
                                                    wins; unset: no authentication)
=========================== ======================= ==========================================================

Booleans accept ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (any case). ``TRITON_INTERPRET`` is Triton's own
switch (see :mod:`tilespec.env`), not a tilespec setting.

Two opt-in engine choices that measured slower than the defaults are not environment variables but fields set from
Python (:func:`configure`): ``native_flex`` (FlexAttention's decode kernel instead of SDPA) and ``compiled_prefill``
(torch.compile'd prefill forwards, which fail under dynamic shapes on torch 2.11); so is ``tp_check``, the
tensor-parallel debugging check that compares every forward's inputs across ranks (also ``--tp-check`` and
``shard(..., check=True)``).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Optional

VARIABLES = ("TILESPEC_HOME", "TILESPEC_DATA", "TILESPEC_SYNTH_DIR", "TILESPEC_COMMIT", "TILESPEC_RUN_AHEAD",
             "TILESPEC_NATIVE_KERNELS", "TILESPEC_SDPA", "TILESPEC_DIRECT_LAUNCH", "TILESPEC_TP_ALLREDUCE",
             "TILESPEC_API_KEY")
SDPA_BACKENDS = ("math", "flash", "efficient", "cudnn")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The parsed environment (see the module docstring for each field's variable and default)."""
    home: Path
    data: Path
    synth_dir: Optional[Path]
    commit: Optional[str]
    run_ahead: bool
    native_kernels: Optional[str]     # None: the engine's default set
    sdpa: str
    direct_launch: bool
    tp_allreduce: Optional[str]       # None: auto
    api_key: Optional[str] = dataclasses.field(default=None, repr=False)   # a secret: kept out of repr
    native_flex: bool = False         # set from Python only (configure)
    compiled_prefill: bool = False    # set from Python only (configure)
    tp_check: bool = False            # set from Python only (configure)


def _flag(name: str, raw: Optional[str], default: bool) -> bool:
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")


def _sdpa(raw: Optional[str]) -> str:
    names = [s.strip().lower() for s in (raw or "").split(",") if s.strip()]
    bad = [s for s in names if s not in SDPA_BACKENDS]
    if bad:
        raise ValueError(f"TILESPEC_SDPA={raw!r}: unknown back-end(s) {', '.join(bad)}; expected a comma list of "
                         f"{', '.join(SDPA_BACKENDS)} (or empty for PyTorch's choice)")
    return ",".join(names)


def _allreduce(raw: Optional[str]) -> Optional[str]:
    value = (raw or "").strip().lower()
    if value and value not in ("symm", "nccl", "best"):
        raise ValueError(f"TILESPEC_TP_ALLREDUCE={raw!r}: expected symm or nccl or best (or unset for auto)")
    return value or None


def parse(env) -> Settings:
    """Settings from a mapping of environment variables (``os.environ``); raises ValueError on a bad value."""
    home = Path(env.get("TILESPEC_HOME") or Path.home() / ".cache" / "tilespec").expanduser()
    data = env.get("TILESPEC_DATA")
    synth = env.get("TILESPEC_SYNTH_DIR")
    return Settings(
        home=home,
        data=Path(data).expanduser() if data else home / "data",
        synth_dir=Path(synth).expanduser() if synth else None,
        commit=env.get("TILESPEC_COMMIT") or None,
        run_ahead=_flag("TILESPEC_RUN_AHEAD", env.get("TILESPEC_RUN_AHEAD"), True),
        native_kernels=env.get("TILESPEC_NATIVE_KERNELS"),
        sdpa=_sdpa(env.get("TILESPEC_SDPA")),
        direct_launch=_flag("TILESPEC_DIRECT_LAUNCH", env.get("TILESPEC_DIRECT_LAUNCH"), True),
        tp_allreduce=_allreduce(env.get("TILESPEC_TP_ALLREDUCE")),
        api_key=env.get("TILESPEC_API_KEY") or None,
    )


_CACHE: dict = {}
_OVERRIDES: dict = {}


def get() -> Settings:
    """The current settings: parsed once per distinct set of values of :data:`VARIABLES` (cheap to call)."""
    raw = tuple(os.environ.get(name) for name in VARIABLES)
    found = _CACHE.get(raw)
    if found is None:
        found = parse(os.environ)
        _CACHE.clear()
        _CACHE[raw] = found
    return dataclasses.replace(found, **_OVERRIDES) if _OVERRIDES else found


def configure(**fields) -> None:
    """Set fields from Python for this process (e.g. ``configure(native_flex=True)`` in a benchmark script), on top
    of the environment; ``configure()`` with no fields clears them. Unknown names are an error."""
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if not fields:
        _OVERRIDES.clear()
    _OVERRIDES.update(fields)
