"""``tilespec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over continuous batching with exact
speculative decoding: the paged engine (:mod:`tilespec.engine.paged`: paged K/V, prefix caching, chunked prefill in
the decode batch) for Llama-family targets with context drafts or none, else :mod:`tilespec.engine.batching` (draft
models, trained heads, other families). See docs/serve.md.

    from tilespec.serve import build_server
    app = build_server(target_model, tokenizer, draft="ngram", model_name="my-model", max_batch=16)
    uvicorn.run(app, port=8000)
"""
from __future__ import annotations


PAGED_ONLY = ("token_budget", "block_size", "num_blocks", "kv_fraction", "prefix_caching")
BATCH_ONLY = ("capacity",)


def pick_engine(target, draft, engine: str, options: dict) -> str:
    """"paged" or "batch" for ``engine`` = "auto" | "paged" | "batch": auto takes the paged engine wherever it can
    serve the pair (engine/paged/engine.paged_reason) and no BatchEngine-only option is set."""
    from tilespec.engine.paged.engine import paged_reason
    if engine not in ("auto", "paged", "batch"):
        raise ValueError(f"engine must be 'auto', 'paged' or 'batch', got {engine!r}")
    reason = paged_reason(target, draft)
    if engine == "paged" and reason is not None:
        raise ValueError(f"the paged engine cannot serve this: {reason}; use --engine batch")
    if engine == "auto":
        engine = "batch" if reason is not None or any(options.get(k) is not None for k in BATCH_ONLY) else "paged"
    wrong = PAGED_ONLY if engine == "batch" else BATCH_ONLY
    given = [k for k in wrong if options.get(k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} do not apply to the {engine} engine")
    return engine


def make_engine(target, draft, *, engine: str = "auto", max_batch: int = 8, gamma: int = 4, max_len=None,
                tokenizer=None, pad_token_id: int = 0, prefill_chunk: int = 512, **options):
    """The serving engine (see :func:`pick_engine`) with ``options`` of that engine."""
    options = {k: v for k, v in options.items() if v is not None}
    if pick_engine(target, draft, engine, options) == "batch":
        from tilespec.engine.batching import BatchEngine
        return BatchEngine(target, draft, max_batch=max_batch, gamma=gamma, max_len=max_len, tokenizer=tokenizer,
                           pad_token_id=pad_token_id, prefill_chunk=prefill_chunk, **options)
    from tilespec.engine.paged import PagedEngine
    options["compile"] = bool(options.get("compile", False))
    options.setdefault("token_budget", prefill_chunk + max_batch * (1 + gamma))
    return PagedEngine(target, draft, max_batch=max_batch, gamma=gamma, max_len=max_len, tokenizer=tokenizer,
                       pad_token_id=pad_token_id, **options)


def build_server(target, tokenizer, *, draft=None, model_name: str = "model", max_batch: int = 8, gamma: int = 4,
                 max_len=None, max_queue: int = 256, default_max_tokens: int = 256, shutdown_timeout: float = 30.0,
                 chat: bool = True, warmup: bool = True, log=None, max_body_mb: float = 4.0, api_key=None,
                 cors_origins=(), engine: str = "auto", **engine_options):
    """The FastAPI app serving loaded ``target`` (and ``draft``: anything SpeculativeDecoder takes -- None, a draft
    model, "ngram" / "suffix", "head" / "head+ngram" / a head folder, [model, "ngram"], a Drafter) under
    ``model_name``. ``engine``: "auto" (the paged engine where it serves the pair, else BatchEngine), "paged" or
    "batch"; ``engine_options`` go to it (method, compile, adaptive, spec_max_batch, eos_token_id, prefill_chunk;
    paged: token_budget, block_size, num_blocks, kv_fraction, prefix_caching; batch: capacity). ``warmup``: compile
    and capture every step shape before serving (CUDA graphs only), reporting progress to ``log``. ``max_body_mb``,
    ``api_key``, ``cors_origins``: see :func:`tilespec.serve.app.build_app`."""
    from tilespec.engine.batch_warmup import warm_up

    from .app import build_app
    from .worker import EngineWorker
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    pad = getattr(inner, "pad_token_id", None)
    eng = make_engine(target, draft, engine=engine, max_batch=max_batch, gamma=gamma, max_len=max_len,
                      tokenizer=inner, pad_token_id=pad if pad is not None else 0, **engine_options)
    if warmup:
        eng.warm_up(log=log) if hasattr(eng, "warm_up") else warm_up(eng, log=log)
    return build_app(EngineWorker(eng, max_queue=max_queue), model_name, inner,
                     default_max_tokens=default_max_tokens, shutdown_timeout=shutdown_timeout, chat=chat,
                     max_body_mb=max_body_mb, api_key=api_key, cors_origins=cors_origins)
