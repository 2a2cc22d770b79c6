"""``tilespec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over continuous batching with exact
speculative decoding (:mod:`tilespec.engine.batching`). See docs/serve.md.

    from tilespec.serve import build_server
    app = build_server(target_model, tokenizer, draft="ngram", model_name="my-model", max_batch=16)
    uvicorn.run(app, port=8000)
"""
from __future__ import annotations


def build_server(target, tokenizer, *, draft=None, model_name: str = "model", max_batch: int = 8, gamma: int = 4,
                 max_len=None, max_queue: int = 256, default_max_tokens: int = 256, shutdown_timeout: float = 30.0,
                 chat: bool = True, warmup: bool = True, log=None, max_body_mb: float = 4.0, api_key=None,
                 cors_origins=(), **engine_options):
    """The FastAPI app serving loaded ``target`` (and ``draft``: anything SpeculativeDecoder takes -- None, a draft
    model, "ngram" / "suffix", "head" / "head+ngram" / a head folder, [model, "ngram"], a Drafter) under
    ``model_name``; ``engine_options`` go to :class:`~tilespec.engine.batching.BatchEngine` (method, compile,
    capacity, prefill_chunk, spec_max_batch, eos_token_id, ...). ``warmup``: compile and capture every step shape
    before serving (engine/batch_warmup.py; on CUDA graphs only), reporting progress to ``log``. ``max_body_mb``,
    ``api_key``, ``cors_origins``: see :func:`tilespec.serve.app.build_app`."""
    from tilespec.engine.batch_warmup import warm_up
    from tilespec.engine.batching import BatchEngine

    from .app import build_app
    from .worker import EngineWorker
    inner = getattr(tokenizer, "tokenizer", tokenizer)
    pad = getattr(inner, "pad_token_id", None)
    engine = BatchEngine(target, draft, max_batch=max_batch, gamma=gamma, max_len=max_len, tokenizer=inner,
                         pad_token_id=pad if pad is not None else 0, **engine_options)
    if warmup:
        warm_up(engine, log=log)
    return build_app(EngineWorker(engine, max_queue=max_queue), model_name, inner,
                     default_max_tokens=default_max_tokens, shutdown_timeout=shutdown_timeout, chat=chat,
                     max_body_mb=max_body_mb, api_key=api_key, cors_origins=cors_origins)
