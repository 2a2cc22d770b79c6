"""The systems ``tilespec bench e2e`` times, each over the same prompt batches, and the configuration they run in.

Systems (``Config.kind``):
  * ``hf``: transformers ``generate`` with its default dynamic cache (left-padded batches);
  * ``hf-static``: ``generate(cache_implementation="static")``; on CUDA transformers compiles the decode forward;
  * ``hf-assisted``: transformers assisted generation with the draft model (batch 1 only in transformers);
  * ``hf-prompt-lookup``: transformers prompt lookup decoding (``prompt_lookup_num_tokens``; batch 1 only);
  * ``ar``: our engine, target-only; ``tilespec``: our engine with ``--draft`` (any draft name the engine takes: a
    model, ``ngram`` / ``suffix``, ``MODEL+ngram``, ...), per verify method;
  * NAME: our engine with the drafter the engine's drafter names resolve for NAME (``ngram``, ``suffix``, or any
    drafter registered later): ``SpeculativeDecoder(target, NAME)``;
  * ``tilespec+NAME``: that drafter with the ``--draft`` model as its fallback (``[model, NAME]``).
The names pass through :func:`tilespec.engine.drafters.split_draft_name` / ``draft_spec``, so a drafter the engine
learns to resolve is a system here without a change to this file.

Warm-up (never timed): systems that compile or capture (``hf-static``, ours) run every batch ``warmup`` times right
before its timed run, with the same seeds and lengths, so the timed run replays what the warm-up compiled; the
other HF systems warm up once on the first batch with a few tokens. ``compile_seconds`` = warm-up time minus the
timed time of the same batches (the cost the first run of each shape pays). ``max_seconds`` > 0 stops a system after
the batch that crosses it: ``requests`` is then the number measured (always a prefix of the prompts).
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass

HF_KINDS = ("hf", "hf-static", "hf-assisted", "hf-prompt-lookup")
BATCH1_ONLY = ("hf-assisted", "hf-prompt-lookup")
DRAFT_MODEL = "tilespec"     # the --draft of the run; "tilespec+NAME" = drafter NAME with the --draft model as fallback
LIGHT_WARMUP_TOKENS = 8


def engine_draft_name(kind: str) -> tuple | None:
    """(uses the --draft model, drafter name or None) of one of our engine's system kinds, None for other kinds:
    ``ar`` -> (False, None), ``tilespec`` -> (True, None), NAME -> (False, NAME), ``tilespec+NAME`` -> (True, NAME),
    where NAME is a drafter name the engine resolves (``split_draft_name``)."""
    from tilespec.engine.drafters import split_draft_name

    if kind == "ar":
        return False, None
    if kind == DRAFT_MODEL:
        return True, None
    if kind in HF_KINDS:
        return None
    try:
        model, name = split_draft_name(kind)
    except ValueError:
        return None
    if name is None or model not in (None, DRAFT_MODEL):
        return None
    return model is not None, name


DEFAULT_SYSTEMS = ["ar", "hf-static", "tilespec", "ngram", "suffix", "hf-prompt-lookup", "hf-assisted", "hf"]
SYSTEMS_HELP = (f"comma list of {', '.join(HF_KINDS)}, ar (target-only), tilespec (--draft), a drafter name the engine "
                "resolves (ngram, suffix, ...) or tilespec+NAME (that drafter with the --draft model as fallback)")


def system_rank(kind: str) -> int:
    """Timing order: ``ar`` first (the others compare to it), then hf-static, ours, then the HF systems."""
    fixed = {"ar": 0, "hf-static": 1, DRAFT_MODEL: 2, "hf-prompt-lookup": 5, "hf-assisted": 6, "hf": 7}
    if kind in fixed:
        return fixed[kind]
    return 4 if engine_draft_name(kind)[0] else 3


def is_engine_kind(kind: str) -> bool:
    return engine_draft_name(kind) is not None


def needs_draft_model(kind: str) -> bool:
    """Systems that cannot run without a --draft model: HF assisted generation and ``tilespec+NAME``."""
    parsed = engine_draft_name(kind)
    return kind == "hf-assisted" or (parsed is not None and parsed[0] and parsed[1] is not None)


@dataclass(frozen=True)
class Config:
    """One timed configuration; ``key`` identifies it in the JSON (resume skips keys already measured)."""

    task: str
    temperature: float
    batch_size: int
    kind: str
    method: str | None = None       # verify method (speculative kinds)
    engine: str = "eager"           # our engine's step mode: eager, graphs, ...
    gamma: int | None = None        # constant γ, or the initial γ of an adaptive schedule (None: --tree auto)
    schedule: str | None = None     # constant | heuristic | optimal (speculative kinds)

    @property
    def system(self) -> str:
        if self.kind in HF_KINDS:
            return self.kind
        name = self.kind if self.method is None else f"{self.kind}:{self.method}"
        if self.schedule is not None:
            name += f"/{self.schedule}" if self.schedule != "constant" else \
                "/tree-auto" if self.gamma is None else f"/g{self.gamma}"   # None: an auto tree, γ = its depth
        return name + ("" if self.engine == "eager" else f"@{self.engine}")

    @property
    def key(self) -> str:
        return f"{self.task}|T={self.temperature:g}|B={self.batch_size}|{self.system}"


def sampling_filters(args, temperature: float) -> dict:
    """{top_k, top_p, min_p} of every system at ``temperature`` (``--top-k`` / ``--top-p`` / ``--min-p``; none at
    T = 0, where greedy decoding ignores them)."""
    if temperature == 0:
        return {}
    return {"top_k": getattr(args, "top_k", 0), "top_p": getattr(args, "top_p", 1.0),
            "min_p": getattr(args, "min_p", 0.0)}


def output_hash(tokens: list) -> str:
    """Short digest of one request's new tokens (rows compare outputs without storing them)."""
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _truncate(row: list, eos: set) -> list:
    for j, t in enumerate(row):
        if t in eos:
            return row[:j + 1]
    return row


def _eos(model, tok) -> set:
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if e is None and tok is not None:
        e = getattr(tok, "eos_token_id", None)
    return set() if e is None else ({int(e)} if isinstance(e, int) else {int(x) for x in e})


def _timed_batches(batches, max_seconds, run_one, warm_one, warmup: int):
    """Run ``warm_one`` ``warmup`` times then ``run_one`` per batch; stop after the batch crossing max_seconds.
    ``run_one(i, batch)`` returns (output, timed seconds). Returns (outputs, timed seconds, warm-up seconds)."""
    outs, timed, warm = [], 0.0, 0.0
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        for _ in range(warmup):
            warm_one(i, batch)
        warm += time.perf_counter() - t0
        out, dt = run_one(i, batch)
        outs.append(out)
        timed += dt
        if max_seconds and timed >= max_seconds:
            break
    return outs, timed, warm


def run_hf(cfg: Config, target, draft, batches, args, device, tok, feats=None) -> dict:
    """One transformers system over ``batches`` (token id lists; Whisper: decoder prefixes with encoder ``feats``
    [N, mels, frames], HF builds its own prefix from language/task); returns sequences, timings, peak memory."""
    import torch
    from tilespec.engine.metrics import peak_memory
    pad = tok.pad_token_id if tok is not None and getattr(tok, "pad_token_id", None) is not None else 0
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=cfg.temperature > 0, pad_token_id=pad)
    if getattr(args, "ignore_eos", False):
        gen["min_new_tokens"] = args.max_new_tokens
    if cfg.temperature > 0:
        filters = sampling_filters(args, cfg.temperature)
        gen.update(temperature=cfg.temperature, top_k=filters["top_k"], top_p=filters["top_p"],
                   min_p=filters["min_p"] or None)
    if cfg.kind == "hf-static":
        gen["cache_implementation"] = "static"
    elif cfg.kind == "hf-assisted":
        from tilespec.engine.drafters import draft_model
        gen.update(assistant_model=draft_model(draft), num_assistant_tokens=cfg.gamma, assistant_confidence_threshold=0.0,
                   num_assistant_tokens_schedule="constant" if cfg.schedule == "constant" else "heuristic")
    elif cfg.kind == "hf-prompt-lookup":
        gen.update(prompt_lookup_num_tokens=args.lookup_tokens)
    eos = set() if getattr(args, "ignore_eos", False) else _eos(target, tok)
    starts = {id(b): sum(len(x) for x in batches[:i]) for i, b in enumerate(batches)}

    def call(batch, **over):
        if feats is not None:
            f = feats[starts[id(batch)]:starts[id(batch)] + len(batch)]
            kw = {k: v for k, v in {**gen, **over}.items() if k != "pad_token_id"}
            _sync(device)
            t0 = time.perf_counter()
            lang = dict(language="en", task="transcribe") \
                if getattr(target.generation_config, "is_multilingual", True) else {}   # .en models: no language
            out = target.generate(input_features=f, **lang, **kw).tolist()
            _sync(device)
            rows = [_truncate(r[len(p):] if r[:len(p)] == p else r, eos) for r, p in zip(out, batch)]
            # Whisper's generate drops the end-of-text token of a request that ended alone (B=1); a row shorter
            # than max_new_tokens ended on it, so it is put back (our engine's rows and HF's batched rows keep it)
            end, cap = (min(eos) if eos else None), kw.get("max_new_tokens", 0)
            rows = [r + [end] if end is not None and len(r) < cap and (not r or r[-1] not in eos) else r
                    for r in rows]
            return rows, time.perf_counter() - t0
        width = max(len(ids) for ids in batch)
        x = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=device)
        _sync(device)
        t0 = time.perf_counter()
        out = target.generate(x, attention_mask=mask, **{**gen, **over})
        _sync(device)
        return [_truncate(r, eos) for r in out[:, width:].tolist()], time.perf_counter() - t0

    full = cfg.kind == "hf-static"
    warm_one = (lambda i, b: call(b)) if full else (lambda i, b: None)
    warm = 0.0
    if not full and args.warmup and batches:
        t0 = time.perf_counter()
        call(batches[0], max_new_tokens=min(LIGHT_WARMUP_TOKENS, args.max_new_tokens))
        warm = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    outs, timed, warm_full = _timed_batches(batches, args.max_seconds, lambda i, b: call(b), warm_one,
                                            args.warmup if full else 0)
    seqs = [s for out in outs for s in out]
    res = dict(sequences=seqs, new_tokens=sum(map(len, seqs)), wall_time=timed, warmup_seconds=warm + warm_full,
               peak_memory_bytes=peak_memory(device))
    if full:
        res["compile_seconds"] = max(0.0, warm_full / max(args.warmup, 1) - timed)
    return res


def make_decoder(cfg: Config, target, draft, args):
    """Our decoder for ``cfg``; RuntimeError naming the gap when this engine lacks a context drafter."""
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams
    from tilespec.engine.drafters import draft_model, draft_spec
    with_model, name = engine_draft_name(cfg.kind)
    if cfg.kind == DRAFT_MODEL and draft is None:
        raise RuntimeError("the tilespec system needs --draft (a model, or any draft name the engine takes)")
    if with_model and name is not None and draft_model(draft) is None:
        raise RuntimeError(f"the {cfg.kind} system needs a draft model (--draft NAME)")
    the_draft = draft if cfg.kind == DRAFT_MODEL else draft_spec(draft_model(draft) if with_model else None, name)
    kw = dict(gamma=cfg.gamma or 1, gamma_schedule=cfg.schedule or "constant", method=cfg.method or "reference",
              sampling=SamplingParams(temperature=cfg.temperature, **sampling_filters(args, cfg.temperature)),
              compile={"eager": False, "auto": True}.get(cfg.engine, cfg.engine))
    if getattr(args, "ignore_eos", False):
        kw["eos_token_id"] = []          # no stop token: exactly max_new_tokens per request
    if getattr(args, "tree", None) and the_draft is not None:     # token trees (drafters/trees.py); "auto": the
        from tilespec.bench.tree_args import tree_option           # shape from the head's acceptance at cfg's T
        kw.update(tree=tree_option(args), gamma_schedule="constant")
    try:
        return SpeculativeDecoder(target, the_draft, **kw)
    except (TypeError, ValueError) as err:
        if name is not None:
            raise RuntimeError(f"this engine has no drafter {name!r} (SpeculativeDecoder(draft={the_draft!r}) says: "
                               f"{err})") from err
        raise


def capture_every_gamma(dec, batch, max_new_tokens: int, feats=None) -> None:
    """Warm-up for an adaptive γ schedule on a compiled runtime: one generation of ``batch`` per γ it can choose
    (1..max_gamma, each pinned by a constant schedule, same cache size), so that no CUDA-graph capture of a new γ
    lands in a timed run (a capture there can take most of the run's time).
    The measured costs of those runs are dropped: the timed schedule starts from its own warm-up generation."""
    from tilespec.engine.gamma import GammaSchedule
    if dec.drafter is None or dec.gamma_schedule == "constant" or not dec.compile:
        return
    factory = dec.schedule_factory
    try:
        for g in range(1, dec.max_gamma + 1):
            dec.schedule_factory = lambda kind, gamma, max_gamma, g=g, **kw: GammaSchedule("constant", g, max_gamma)
            dec.generate(batch, max_new_tokens=max_new_tokens, seed=0, input_features=feats)
    finally:
        dec.schedule_factory = factory
        dec._costs.pop(len(batch), None)


def run_engine(cfg: Config, target, draft, batches, args, device, feats=None) -> dict:
    """Our engine over ``batches``: sequences, timings, the engine's stats per batch and the derived α, τ, c."""
    from tilespec.engine import RunStats, expected_speedup
    dec = make_decoder(cfg, target, draft, args)
    starts = [sum(len(b) for b in batches[:i]) for i in range(len(batches))]

    def one(i, batch):
        f = None if feats is None else feats[starts[i]:starts[i] + len(batch)]
        out = dec.generate(batch, max_new_tokens=args.max_new_tokens, seed=1000 * i, input_features=f)
        return out, out.stats.wall_time

    def warm_one(i, batch):
        shape = (len(batch), dec.cache_capacity(max(map(len, batch)), len(batch), args.max_new_tokens))
        if shape not in captured:
            captured.add(shape)
            capture_every_gamma(dec, batch, args.max_new_tokens, None if feats is None else
                                feats[starts[i]:starts[i] + len(batch)])
        one(i, batch)

    captured: set = set()
    outs, timed, warm = _timed_batches(batches, args.max_seconds, one, warm_one, args.warmup)
    if cfg.engine == "compiled-graphs":  # leave the models as they were for the next system (HF baselines: eager)
        from tilespec.engine.drafters import draft_model
        from tilespec.engine.runner import uncompile_decoder_layers
        for m in (target, draft_model(draft)) if draft_model(draft) is not None else (target,):
            uncompile_decoder_layers(m)
    runs = [o.stats for o in outs]
    tot = RunStats.merge(runs)
    times = tot.times
    res = dict(sequences=[s for o in outs for s in o.sequences], new_tokens=tot.new_tokens, wall_time=timed,
               warmup_seconds=warm,
               compile_seconds=max(0.0, warm / max(args.warmup, 1) - timed) if args.warmup else None,
               engine_compile_seconds=tot.compile_seconds, times=times, steps=tot.steps,
               peak_memory_bytes=tot.peak_memory_bytes, kv_cache_bytes=tot.kv_cache_bytes, defrags=tot.defrags,
               target_calls=tot.target_calls, draft_calls=tot.draft_calls,
               target_forward_ms=1e3 * times.get("target", 0.0) / tot.target_calls if tot.target_calls else None,
               draft_forward_ms=1e3 * times.get("draft", 0.0) / tot.draft_calls if tot.draft_calls else None,
               verify_share=None if math.isnan(tot.verify_share) else tot.verify_share,
               runs=[s.to_dict() for s in runs])
    for name in ("runtime", "draft_runtime", "drafter"):
        if getattr(runs[0], name, None):
            res[name] = getattr(runs[0], name)
    from tilespec.bench.tree_args import chosen_tree
    tree = chosen_tree(dec)            # the tree drafted: branch, depth, nodes, and where an auto shape came from
    if tree is not None:
        res["tree"] = tree
    if cfg.kind == "ar":
        res["target_q"] = 1
        return res
    rs = tot.request_steps
    context = tot.context_steps > 0    # the engine drafted from the context on some steps
    c = tot.cost_ratio
    if c is None and context:  # no draft forward: the lookup is host work inside the step
        c = 0.0
    alpha_t = tot.alpha_tested if tot.tested else None
    # Thm 3.8 assumes γ drafted every step; context drafters draft only where the context matches, so they use the
    # tokens drafted per request-step (rounded), like adaptive schedules use their mean γ
    g = (max(1, round(tot.drafted / rs)) if context and rs else
         dec.gamma if cfg.schedule == "constant" else max(1, round(tot.mean_gamma)))   # a tree's: its depth
    if context:
        res["match_share"] = tot.match_share if rs else None
    res.update(alpha=tot.alpha if tot.drafted else None, alpha_tested=alpha_t, cost_ratio=c,
               block_efficiency=tot.block_efficiency if rs else None, mean_gamma=tot.mean_gamma,
               fallback_steps=tot.fallback_steps, target_q=g + 1, predicted_speedup_gamma=g,
               predicted_speedup=(expected_speedup(min(alpha_t, 0.999999), g, c)
                                  if c is not None and alpha_t is not None else None))
    return res
