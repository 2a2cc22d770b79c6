"""The settings of an evaluation run (:class:`EvalConfig`, recorded verbatim in the results JSON) and what they
imply for the engine: the default method set (every registered method whose registry record says ``evaluate``),
each method's options under the protocol (sigmoid's (α, β) = (-s, s) per task), and the decoder's compile mode.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

BASELINE = "hf"
SIGMOID_SCALE = {"summarization": 1e4, "asr": 1e3}   # the paper's α = -s, β = s per task


def default_methods() -> tuple:
    """The methods an evaluation runs by default: every registered method whose record says ``evaluate``."""
    from tilespec.verify.registry import all_methods
    return tuple(m.name for m in all_methods() if m.evaluate)


def method_options(method: str, cfg: "EvalConfig") -> dict:
    """The options ``method`` runs with under ``cfg``: sigmoid gets the protocol's (α, β) = (-s, s)."""
    return {"alpha": -float(cfg.sigmoid_scale), "beta": float(cfg.sigmoid_scale)} if method == "sigmoid" else {}


@dataclass
class EvalConfig:
    """Settings of one evaluation run (recorded verbatim in the results JSON)."""

    task: str = "summarization"
    dataset: str = "xsum"
    limit: Optional[int] = None
    seed: int = 0
    methods: tuple = field(default_factory=default_methods)
    target: str = "qwen2.5-coder-1.5b-instruct"
    draft: Optional[str] = "qwen2.5-coder-0.5b-instruct"
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 100
    temperature: float = 1.0
    gamma: int = 5
    schedule: str = "heuristic"
    max_gamma: int = 20
    sigmoid_scale: Optional[float] = None
    max_article_chars: Optional[int] = 4000
    studies: tuple = ("main",)
    sweep_limit: int = 4
    sweep_gammas: tuple = tuple(range(1, 21))
    accept_gammas: tuple = (3, 5, 10, 15)
    scales: tuple = (10.0, 1e3, 1e4, 1e5)
    sweep_max_new_tokens: int = 40
    sweep_schedule: str = "constant"
    warmup: bool = True
    compile: str = "auto"
    time_budget: Optional[float] = None
    main_share: float = 0.6
    summary_every_s: float = 60.0   # intermediate summaries (metric of every text) at most this often
    batch_size: int = 1      # main comparison only; > 1 is not the paper's batch-1 protocol (harness docstring)

    COMPILE_MODES = ("auto", "eager", "graphs", "compiled-graphs", "native", "native-graphs")

    def __post_init__(self):
        self.methods = tuple(self.methods)
        from tilespec.verify.registry import available_methods
        unknown = [m for m in self.methods if m not in available_methods()]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(available_methods())}")
        if not self.methods:
            raise ValueError("at least one method is needed")
        if self.task not in SIGMOID_SCALE:
            raise ValueError(f"unknown task {self.task!r}; choose summarization or asr")
        for name in ("max_new_tokens", "gamma", "max_gamma", "sweep_limit", "sweep_max_new_tokens", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit must be a positive integer, got {self.limit!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and ("sigmoid" in self.methods or "alphabeta" in self.studies):
            raise ValueError("sigmoid has no greedy mode (temperature 0): drop it from --methods / --studies or "
                             "sample (temperature > 0)")
        bad = [s for s in self.studies if s not in ("main", "acceptance", "gamma", "alphabeta")]
        if bad:
            raise ValueError(f"unknown studies {bad}; choose from main, acceptance, gamma, alphabeta")
        if any(g < 1 for g in tuple(self.sweep_gammas) + tuple(self.accept_gammas)):
            raise ValueError("gamma values must be >= 1")
        if any(s <= 0 for s in self.scales):
            raise ValueError("sigmoid scales must be > 0 (alpha = -s, beta = s)")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"time_budget must be > 0 seconds, got {self.time_budget!r}")
        if not 0 < self.main_share <= 1:
            raise ValueError(f"main_share must be in (0, 1], got {self.main_share!r}")
        if self.sweep_schedule not in ("constant", "heuristic"):
            raise ValueError(f"sweep_schedule must be constant or heuristic, got {self.sweep_schedule!r}")
        if self.compile not in self.COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(self.COMPILE_MODES)}, got {self.compile!r}")
        if self.sigmoid_scale is None:
            self.sigmoid_scale = SIGMOID_SCALE[self.task]

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


def engine_compile(cfg: EvalConfig, device) -> bool | str:
    """The ``compile`` argument for :class:`SpeculativeDecoder`: "auto" = the engine's default fast path on CUDA
    (``compile=True``: the native compiled runtime for supported models, CUDA graphs of the transformers modules
    otherwise), eager elsewhere; "eager" = False; the other modes are passed on as they are."""
    if cfg.compile == "eager":
        return False
    if cfg.compile != "auto":
        return cfg.compile
    return torch.device(device).type == "cuda"
