"""``tilespec serve``: the OpenAI-compatible server (tilespec.serve) on uvicorn.

Everything that can be checked without the model is checked before it loads (a load takes minutes on a large
model): the port range, the compile mode (and that a CUDA-graph mode has a CUDA device), the verification method,
the body limit, and that the host and port can be bound (a port in use fails at once, not after the load). The
checks that need torch (the method's name, the device) run right after the engine process is spawned, beside its
imports: importing torch first (seconds with the CUDA libraries) delayed the whole start by that much.
"""
from __future__ import annotations

import argparse
import errno
import os
import socket

from tilespec.cli._args import non_negative_float, non_negative_int, positive_int, probability

COMPILE_MODES = ("auto", "off", "native", "native-graphs", "graphs", "compiled-graphs", "default", "reduce-overhead",
                 "max-autotune", "max-autotune-no-cudagraphs")
CUDA_ONLY = ("native-graphs", "graphs", "compiled-graphs")


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 65535], got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, 65535], got {port}")
    return port


def positive_mb(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 4096:
        raise argparse.ArgumentTypeError(f"must be a number of MiB in (0, 4096], got {text!r}")
    return value


MAX_NODES = 64     # tilespec.multidraft.token_tree.MAX_NODES: importing it here would import torch before the spawn
TREE_BRANCH, TREE_DEPTH = 8, 6     # --tree N: the shape `tilespec generate --tree N` gives (bench/tree_args.py)


def _ints(text: str, count: int, form: str) -> tuple:
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != count:
        raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}")
    return values


def tree_shape(text: str) -> tuple:
    """argparse ``type`` of ``--tree``: ``B,D,N`` (branch or n-gram matches, depth, nodes with the root) or ``N``
    (branch 8, depth 6, as ``tilespec generate --tree N``) -> (branch, depth, nodes)."""
    if str(text).strip().lower() == "auto":
        raise argparse.ArgumentTypeError("auto chooses a shape for one temperature and a server serves every "
                                         "temperature: give B,D,N (e.g. 4,4,16)")
    if "," not in str(text):
        tree = (TREE_BRANCH, TREE_DEPTH, *_ints(text, 1, "B,D,N or N"))
    else:
        tree = _ints(text, 3, "B,D,N (branch, depth, nodes), e.g. 4,4,16")
    if min(tree[:2]) < 1 or not 2 <= tree[2] <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"B,D,N needs branch, depth >= 1 and 2 <= nodes <= {MAX_NODES} (the root "
                                         f"included), got {text!r}")
    return tree


def chains_shape(text: str) -> tuple:
    """argparse ``type`` of ``--chains``: ``K,L`` -> (K, L), 1 + K L <= 64 nodes."""
    k, length = _ints(text, 2, "K,L (chains, tokens per chain), e.g. 2,4")
    if k < 1 or length < 1 or 1 + k * length > MAX_NODES:
        raise argparse.ArgumentTypeError(f"K,L needs K, L >= 1 and 1 + K L <= {MAX_NODES} nodes, got {text!r}")
    return k, length


def engine_cpus_choice(text: str) -> str:
    """argparse ``type`` of ``--engine-cpus``: auto, none, or a list of this process's CPUs."""
    from tilespec.serve.cpus import engine_cpus
    try:
        engine_cpus(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def default_api_servers() -> int:
    """Four API processes on a host of 16 or more CPUs, two on 8 or more, else one. On a 16-core H200 host at 256
    clients four delivered 0.88 of the engine's in-process rate (bench/results/serve-load-api4-qwen1.5b-h200.json)
    where two had delivered 0.71 (serve-load-qwen1.5b-h200.json; one streams ~26k tok/s over a fake engine, two
    ~53k: serve-api-ceiling-h200.json); each costs a core."""
    cpus = os.cpu_count() or 1
    return 4 if cpus >= 16 else 2 if cpus >= 8 else 1


def check_bind(host: str, port: int) -> None:
    """Bind ``host:port`` as uvicorn will (SO_REUSEADDR), then release it: RuntimeError naming the fix if not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise RuntimeError(f"--host {host!r} does not resolve ({err.strerror}); use an address such as 127.0.0.1 "
                           f"or 0.0.0.0") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as err:
            hint = "another process listens there: stop it or pick another --port" \
                if err.errno == errno.EADDRINUSE else "pick another --port / --host"
            raise RuntimeError(f"cannot listen on {host}:{port}: {err.strerror} ({hint})") from None


def run(args) -> int:
    from tilespec.serve.timeline import Marks
    marks = Marks()
    marks.mark("imports")       # the interpreter, tilespec and the command line's modules
    from tilespec import settings
    from tilespec.serve import serve_engine
    from tilespec.serve.core import EngineSpec
    from tilespec.serve.named import LoadByName, device_type
    from tilespec.serve.processes import run_server
    named = device_type(args.device)
    if args.compile in CUDA_ONLY and named not in (None, "cuda"):
        raise ValueError(_needs_cuda(args.compile, args.device))
    if args.scheme is not None and args.chains is None:
        raise ValueError("--scheme selects among sampled chains: add --chains K,L (or drop --scheme)")
    check_bind(args.host, args.port)
    api_key = args.api_key or settings.get().api_key
    draft_name = None if args.draft in (None, "none") else args.draft
    if (args.tree or args.chains) and draft_name is None:
        draft_name = "head"     # as `tilespec generate --tree`: the target's trained head drafts the trees
    options = dict(engine=args.engine, max_batch=args.max_batch, gamma=args.gamma, max_len=args.max_len,
                   method=args.method, compile={"off": False}.get(args.compile, args.compile),   # auto: make_engine
                   prefill_chunk=args.prefill_chunk, spec_max_batch=args.spec_max_batch,
                   adaptive={"auto": None, "on": True, "off": False}[args.adaptive_spec],
                   pricing=False if args.no_draft_pricing else None,
                   max_admission_wait=None if args.max_prefill_wait_ms is None else args.max_prefill_wait_ms / 1e3,
                   prefix_caching=False if args.no_prefix_caching else None, kv_fraction=args.kv_fraction,
                   deterministic=True if args.deterministic else None,
                   tree=args.tree, chains=args.chains, scheme=args.scheme or "specinfer")
    # the engine process loads the models and owns the GPU; this process only serves HTTP. The spec holds names
    # and strings only, so the engine process is spawned before anything here imports torch
    spec = EngineSpec(load=LoadByName(args.target, draft_name, args.device, args.dtype), options=options,
                      warmup=not args.no_warmup, device=args.device, cpus=args.engine_cpus)
    marks.mark("checks")
    app = serve_engine(spec, model_name=args.served_model_name or args.target, max_queue=args.max_queue,
                       default_max_tokens=args.default_max_tokens, shutdown_timeout=args.shutdown_timeout,
                       chat=not args.no_chat, log=_flushed, max_body_mb=args.max_body_mb, api_key=api_key,
                       cors_origins=tuple(o.strip() for o in (args.cors_origins or "").split(",") if o.strip()),
                       api_servers=args.api_servers, marks=marks, freeze=True, checks=lambda: torch_checks(args))
    print(f"tilespec serve: listening on http://{args.host}:{args.port} (model {args.served_model_name or args.target}, "
          f"{args.api_servers} API process{'es' if args.api_servers > 1 else ''})", flush=True)
    run_server(app, args.host, args.port, log_level=args.log_level)
    return 0


def torch_checks(args) -> None:
    """The checks that import torch, run once the engine process is spawned (it imports torch meanwhile) and before
    any model loads: a method typo, the device, a CUDA-graph compile mode on an "auto" device without CUDA."""
    from tilespec.env import pick_device
    from tilespec.verify.registry import get_method
    get_method(args.method)
    if args.scheme is not None:
        from tilespec.multidraft.schemes import parse_scheme
        parse_scheme(args.scheme)
    if args.device == "auto" and args.compile not in CUDA_ONLY:
        return          # nothing to check: no CUDA initialisation in this process, which never uses the GPU
    device = pick_device(args.device)
    if args.compile in CUDA_ONLY and device.type != "cuda":
        raise ValueError(_needs_cuda(args.compile, device))


def _needs_cuda(mode: str, device) -> str:
    return (f"--compile {mode} captures CUDA graphs and needs a CUDA device (the device is {device}); use --compile "
            f"auto, off or native")


def _flushed(line: str) -> None:
    print(line, flush=True)     # the start-up lines reach a log file (stdout redirected) when they happen


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                       description="Serve TARGET over the OpenAI API (/v1/chat/completions, /v1/completions with "
                                   "stream=true, /v1/models, /health, /metrics); see docs/serve.md.")
    p.add_argument("--target", required=True, help="registry name, model folder, .gguf file or hub id")
    p.add_argument("--draft", default=None,
                   help="none (default), ngram, suffix, head (the target's trained draft head), head+ngram, a head "
                        "folder (optionally +ngram), a draft model name (e.g. NAME:layers=8), or MODEL+ngram")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
                        "TILESPEC_API_KEY environment variable; none: open)")
    p.add_argument("--cors-origins", default=None,
                   help="comma-separated origins browsers may call from ('*' for any; default: no CORS headers)")
    p.add_argument("--max-body-mb", type=positive_mb, default=4.0,
                   help="largest request body in MiB (larger: HTTP 413)")
    p.add_argument("--max-batch", type=positive_int, default=None,
                   help="requests decoded together (default: 256 on the paged engine, 16 on the batch engine)")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="longest prompt + max_tokens (default: the model's context; at most 2048 on the batch "
                        "engine)")
    p.add_argument("--api-servers", type=positive_int, default=default_api_servers(),
                   help="HTTP processes serving the port beside the one engine process (detokenizing and streaming "
                        "spread over that many cores; default 4 on a machine of 16 or more CPUs, 2 on 8 or more, else 1)")
    p.add_argument("--engine-cpus", type=engine_cpus_choice, default="auto", metavar="auto|none|LIST",
                   help="CPUs a GPU engine's step loop keeps to itself once warm, every other server thread off them "
                        "(auto: one physical core, the last, on a machine of 4 or more CPUs; none: the OS places "
                        "it; or a list such as 7,15)")
    p.add_argument("--max-queue", type=positive_int, default=1024, help="waiting requests before 429")
    p.add_argument("--default-max-tokens", type=positive_int, default=256)
    p.add_argument("--gamma", type=non_negative_int, default=4, help="draft tokens per request and step (cap)")
    shapes = p.add_mutually_exclusive_group()
    shapes.add_argument("--tree", type=tree_shape, default=None, metavar="B,D,N",
                        help="draft a token tree per request and step, exact at every temperature (docs/trees.md): "
                             "--draft head (the default with --tree) or a head folder: a dynamic tree of branch B, "
                             "depth D, N nodes with the root; --draft ngram / suffix: B matches of the context of D "
                             f"tokens merged into N nodes. N alone: {TREE_BRANCH},{TREE_DEPTH},N. The paged engine "
                             "verifies trees of at most 16 nodes (the block size)")
    shapes.add_argument("--chains", type=chains_shape, default=None, metavar="K,L",
                        help="draft K chains of L tokens sampled from the head (multi-draft, Khisti et al. 2024; "
                             "--scheme)")
    p.add_argument("--scheme", default=None,
                   help="--chains: the multi-draft scheme, specinfer (default), spectr, is, is-lp, ... (sd for K=1)")
    p.add_argument("--no-draft-pricing", action="store_true",
                   help="paged engine: verify every offered draft (default: each step keeps the drafts that pay by "
                        "its measured step costs and the requests' acceptance)")
    p.add_argument("--max-prefill-wait-ms", type=non_negative_float, default=None,
                   help="paged engine: the longest a waiting request is held so that prompts are prefilled together "
                        "(default 100; held only while that costs the running requests less; 0: admit at once)")
    p.add_argument("--spec-max-batch", type=positive_int, default=None,
                   help="batch engine: draft nothing while more requests than this are decoding (default: always)")
    p.add_argument("--adaptive-spec", choices=("auto", "on", "off"), default="auto",
                   help="batch engine: draft per step row count only where it measures faster than target-only "
                        "steps (auto: on for ngram / suffix alone with --method coupled, where it changes no token)")
    p.add_argument("--no-warmup", action="store_true",
                   help="start serving at once: each step shape then compiles on its first use, stalling the batch "
                        "(default: compile and capture every shape before listening; CUDA graphs only)")
    p.add_argument("--engine", choices=("auto", "paged", "batch"), default="auto",
                   help="paged: paged K/V with prefix caching and chunked prefill in the decode batch (Llama-family "
                        "targets, ngram / suffix / no drafts); batch: fixed rows (draft models, heads, other "
                        "families); auto (default): paged wherever it serves the pair")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="paged engine: do not share full prompt blocks between requests")
    p.add_argument("--deterministic", action="store_true",
                   help="paged engine: batch-invariant kernels, so a request's greedy and seeded outputs are bitwise "
                        "the same whatever the batch, load, prefix cache and drafts (slower steps; docs/serve.md)")
    p.add_argument("--kv-fraction", type=probability, default=None,
                   help="paged engine: share of the free GPU memory for K/V blocks (default 0.5)")
    p.add_argument("--prefill-chunk", type=positive_int, default=512, help="prompt tokens prefilled between steps")
    p.add_argument("--method", default="coupled",
                   help="verification method (default coupled: with n-gram / suffix drafts a request's tokens are "
                        "target-only decoding's whatever is drafted; auto, reference, fused, ...)")
    p.add_argument("--compile", default="auto", choices=COMPILE_MODES, metavar="MODE",
                   help="auto (CUDA graphs on a GPU), off, or a decoder compile mode: native, native-graphs, graphs, "
                        "compiled-graphs, or a torch.compile mode (default, reduce-overhead, max-autotune, "
                        "max-autotune-no-cudagraphs)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--no-chat", action="store_true", help="chat requests without the tokenizer's chat template")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on shutdown before they are cancelled")
    p.add_argument("--log-level", default="info")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)
