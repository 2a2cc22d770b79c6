"""``tilespec serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over continuous batching with exact
speculative decoding: the paged engine (:mod:`tilespec.engine.paged`: paged K/V, prefix caching, chunked prefill in
the decode batch) for Llama-family targets with context drafts, a draft model of their vocabulary, a trained head
(token trees of context drafts and heads too) or none, else :mod:`tilespec.engine.batching` (a draft model's
sampled chains, other families). See docs/serve.md.

Processes (serve/processes.py): the engine process (serve/core.py) owns the GPU and the step loop; the API processes
(serve/client.py, serve/app.py; one by default) take HTTP requests, tokenize, detokenize and stream. They exchange
one zmq message per engine step.

    from tilespec.serve import build_server
    app = build_server(target_model, tokenizer, draft="ngram", model_name="my-model", max_batch=16)
    uvicorn.run(app, port=8000)
"""
from __future__ import annotations

from functools import partial


PAGED_ONLY = ("token_budget", "block_size", "num_blocks", "kv_fraction", "prefix_caching", "pricing",
              "max_admission_wait", "deterministic")
BATCH_ONLY = ("capacity",)
BATCH_SWITCHES = ("adaptive", "spec_max_batch", "min_alpha")   # the paged engine prices every step's drafts instead


def pick_engine(target, draft, engine: str, options: dict) -> str:
    """"paged" or "batch" for ``engine`` = "auto" | "paged" | "batch": auto takes the paged engine wherever it can
    serve the pair (engine/paged/support.choose_engine, the rule ``tilespec.generate`` picks by too) and no
    BatchEngine-only option is set."""
    from tilespec.engine.paged.support import choose_engine, tree_limit
    batch_only = [k for k in BATCH_ONLY if options.get(k) is not None]
    blockers = batch_only if engine == "auto" else []
    limit = tree_limit(draft, options.get("block_size") or 16) if engine != "batch" else None
    if limit is not None:       # a token tree over the paged engine's limits, in words with its fix
        blockers = [*blockers, limit]
    engine = choose_engine(target, draft, engine, "batch", blockers, fix="use --engine batch")
    wrong = PAGED_ONLY if engine == "batch" else BATCH_ONLY + BATCH_SWITCHES
    given = [k for k in wrong if options.get(k) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} do not apply to the {engine} engine")
    return engine


PAGED_MAX_BATCH, BATCH_MAX_BATCH = 256, 16     # default rows: vLLM serves 256+ sequences; fixed rows cost memory


def make_engine(target, draft, *, engine: str = "auto", max_batch=None, gamma: int = 4, max_len=None,
                tokenizer=None, pad_token_id: int = 0, prefill_chunk: int = 512, tree=None, chains=None,
                scheme: str = "specinfer", **options):
    """The serving engine (see :func:`pick_engine`) with ``options`` of that engine; ``max_batch`` None: 256 rows
    on the paged engine, 16 on BatchEngine; ``compile="auto"``: CUDA graphs where the target is on a CUDA device,
    else off. ``tree=(branch, depth, nodes)`` / ``chains=(K, L)`` (with ``scheme``): ``draft`` drafts token trees,
    its tree form built as tilespec.generate builds it (engine/paged/support.tree_drafter), ``gamma`` then the
    trees' depth."""
    options = {k: v for k, v in options.items() if v is not None}
    if tree is not None or chains is not None:
        from tilespec.engine.paged.support import tree_drafter
        draft, gamma = tree_drafter(target, draft, tree=tree, chains=chains, scheme=scheme)
    shape = getattr(draft, "shape", None)
    drafts = shape.nodes - 1 if shape is not None else gamma      # a tree step's draft rows: its nodes past the root
    if options.get("compile") == "auto":        # where the target is: the CLI's engine process resolves the device
        options["compile"] = next(target.parameters()).device.type == "cuda"
    if pick_engine(target, draft, engine, options) == "batch":
        from tilespec.engine.batching import BatchEngine
        if tree is not None or chains is not None:
            check_batch_tree(target, draft, options.get("block_size") or 16)
        return BatchEngine(target, draft, max_batch=max_batch or BATCH_MAX_BATCH, gamma=gamma, max_len=max_len,
                           tokenizer=tokenizer, pad_token_id=pad_token_id, prefill_chunk=prefill_chunk, **options)
    from tilespec.engine.paged import PagedEngine
    max_batch = max_batch or PAGED_MAX_BATCH
    options["compile"] = bool(options.get("compile", False))
    options.setdefault("token_budget", prefill_chunk + max_batch * (1 + drafts))
    return PagedEngine(target, draft, max_batch=max_batch, gamma=gamma, max_len=max_len, tokenizer=tokenizer,
                       pad_token_id=pad_token_id, **options)


def check_batch_tree(target, drafter, block_size: int) -> None:
    """BatchEngine runs a head's token trees (the decoder's tree steps, row by row) but neither context trees nor a
    draft model's sampled chains (their runners keep no per-row state for continuous batching): ValueError naming
    why the paged engine did not take them either, and the fix."""
    from tilespec.engine.paged.head_tree import is_head_tree
    from tilespec.engine.paged.support import paged_reason, tree_limit
    if is_head_tree(drafter):
        return
    why = tree_limit(drafter, block_size) or paged_reason(target, drafter)
    raise ValueError(f"cannot serve the token trees of {drafter.name!r}: BatchEngine runs only a head's, and the paged "
                     f"engine cannot run these: {why}")


def build_server(target, tokenizer, *, draft=None, max_batch=None, gamma: int = 4, max_len=None,
                 engine: str = "auto", warmup: bool = True, engine_hook=None, **options):
    """The FastAPI app serving loaded ``target`` (and ``draft``: anything SpeculativeDecoder takes -- None, a draft
    model, "ngram" / "suffix", "head" / "head+ngram" / a head folder, [model, "ngram"], a Drafter) with
    ``tokenizer``. The models are pickled into the engine process (see :func:`serve_engine` for the process split
    and the server ``options``; the rest go to the engine). ``engine``: "auto" (the paged engine where it serves the
    pair, else BatchEngine), "paged" or "batch"; engine options: method, compile, eos_token_id,
    prefill_chunk; paged: token_budget, block_size, num_blocks, kv_fraction, prefix_caching, pricing, max_admission_wait,
    deterministic; batch: capacity, adaptive, spec_max_batch. ``warmup``: compile and capture the step shapes before serving (CUDA graphs only);
    ``engine_hook``: a picklable callable run on the built engine in its process."""
    from .core import EngineSpec, given
    server = {k: options.pop(k) for k in SERVER_OPTIONS if k in options}
    spec = EngineSpec(load=partial(given, target, draft, tokenizer), warmup=warmup, hook=engine_hook,
                      send_tokenizer=False,
                      options=dict(engine=engine, max_batch=max_batch, gamma=gamma, max_len=max_len, **options))
    return serve_engine(spec, tokenizer, **server)


SERVER_OPTIONS = ("model_name", "max_queue", "default_max_tokens", "shutdown_timeout", "chat", "log", "max_body_mb",
                  "api_key", "cors_origins", "api_servers")


def serve_engine(spec, tokenizer=None, *, model_name: str = "model", max_queue: int = 256,
                 default_max_tokens: int = 256, shutdown_timeout: float = 30.0, chat: bool = True, log=None,
                 max_body_mb: float = 4.0, api_key=None, cors_origins=(), api_servers: int = 1, marks=None,
                 freeze: bool = False, checks=None):
    """The FastAPI app over an engine process built from ``spec`` (serve/core.EngineSpec): the process is started
    and this returns once it is ready (its failure raised here). ``tokenizer``: the API process's (default: the one
    the engine process loaded). ``max_queue``: waiting requests before 429 (per API process);
    ``shutdown_timeout``: seconds running requests get on shutdown; ``max_body_mb``, ``api_key``, ``cors_origins``:
    see :func:`tilespec.serve.app.build_app`; ``log``: where the start-up lines go (the engine's, then the
    start-up timeline once the server listens: serve/timeline.py); ``api_servers``: API processes in all (started
    with the engine process; they need ``spec.send_tokenizer``); ``marks``: the main process's start-up timeline
    so far (serve/timeline.Marks; default: from its launch); ``freeze``: freeze this process's heap (the imports,
    the tokenizer) while the engine warms up (a process that only serves: serve/core.freeze_heap says why);
    ``checks``: called once the processes are spawned (the CLI's checks that import torch, which would have delayed
    the spawn by seconds): what it raises stops them and is raised here."""
    from .cpus import keep_off
    from .processes import EngineProcess
    engine = EngineProcess(spec, api_servers, marks)        # first: the imports below run beside its start
    engine.log = log
    client = engine.client(0, max_queue)
    try:
        if checks is not None:
            checks()
            engine.marks.mark("late checks")
        from .app import build_app
        from .structured import preload_beside
        client.wait_ready(loaded_only=True)         # the tokenizer: unpickled while the engine warms up
        engine.marks.mark("tokenizer")
        preload_beside()
        if freeze:
            from .core import freeze_heap
            freeze_heap()
            engine.marks.mark("gc freeze")
        info = client.wait_ready()
    except BaseException:
        client.close()
        engine.kill()
        raise
    engine.marks.mark("engine ready")
    keep_off(frozenset(info.get("engine_cpus", ())))       # the engine's step loop has that core to itself
    engine.engine_marks = info.get("start_marks")
    inner = getattr(tokenizer, "tokenizer", tokenizer) if tokenizer is not None else client.tokenizer
    if log is not None:
        kv = f", K/V capacity {info['kv_capacity_tokens']:,} tokens ({info['kv_bytes'] / 2**30:.2f} GiB)" \
            if "kv_capacity_tokens" in info else ""
        cpus = info.get("engine_cpus")
        own = f", its step loop on CPU {','.join(map(str, cpus))}" if cpus else ""
        log(f"engine ready: {info['engine']}, {info['max_batch']} rows, context {info['max_len']}{kv}{own}")
    options = dict(model_name=model_name, default_max_tokens=default_max_tokens, shutdown_timeout=shutdown_timeout,
                   chat=chat, max_body_mb=max_body_mb, api_key=api_key, cors_origins=tuple(cors_origins))
    app = build_app(client, tokenizer=inner, engine=engine, **options)
    app.state.api_options = dict(options, max_queue=max_queue)
    engine.marks.mark("app built")
    return app
