"""``tilespec generate``: speculative text generation with a target/draft pair, streamed, with a stats table.

Also holds the argument and printing helpers ``demo`` and ``transcribe`` share (the stats table, streamed text);
loading, prompt encoding and device/dtype picking are library calls (tilespec.api, engine.prompts, tilespec.env).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tilespec.api import load_pair, make_paged, pick_engine
from tilespec.engine.prompts import encode_prompts
from tilespec.env import pick_device, pick_dtype
from tilespec.verify.registry import all_methods

from tilespec.bench.tree_args import add_tree_arguments, chosen_tree, describe, tree_option

from ._args import non_negative_float, non_negative_int, positive_int, probability  # noqa: F401 (shared)

SCHEDULES = ("constant", "heuristic", "optimal")


def check_json_path(path: Path | None) -> None:
    """Fail before any work when ``--json PATH`` cannot be written (a folder, or a folder we may not write)."""
    if path is None:
        return
    if path.is_dir():
        raise ValueError(f"--json {path} is a folder: give a file name, e.g. {path / 'out.json'}")
    folder = next((p for p in [path.parent, *path.parent.parents] if p.exists()), Path("."))
    if not folder.is_dir():
        raise ValueError(f"--json {path} cannot be written ({folder} is a file, not a folder): choose another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"--json {path} cannot be written (no write permission in {folder}): choose another path")


def check_decoding_args(args) -> None:
    """The checks that need no model: run them before loading one (minutes) so a typo fails at once."""
    from tilespec.verify.registry import get_method
    if args.method != "auto":
        get_method(args.method)
    check_json_path(args.json)


def add_decoding_arguments(p) -> None:
    """Options shared by generate / transcribe / demo."""
    p.add_argument("--max-new-tokens", type=positive_int, default=128,
                   help="tokens to generate per request (default 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=non_negative_int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--gamma", type=positive_int, default=5, help="draft tokens per step (initial value if adaptive)")
    p.add_argument("--gamma-schedule", choices=SCHEDULES, default="constant")
    p.add_argument("--method", default="auto",
                   help=f"verification method: auto (fused on a GPU, else reference), "
                        f"{', '.join(m.name for m in all_methods())}")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the counter-based random streams")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="float32 / bfloat16 / float16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--compile", action="store_true", help="compile decode/verify steps (CUDA graphs on GPU)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write texts and stats as JSON")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


ENGINES = ("auto", "decoder", "paged")


def add_engine_argument(p) -> None:
    """``--engine auto | decoder | paged`` (generate, demo): the choice tilespec.generate makes (api.pick_engine)."""
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="paged: the engine tilespec serve runs on (Llama-family targets; no draft, ngram / suffix, "
                        "a Llama-family draft model or a head, and their --tree / head --chains within its limits); "
                        "decoder: SpeculativeDecoder (also γ schedules, a draft model's --chains, other families, "
                        "--tp); auto (default): paged wherever it runs the request (on CUDA)")


def pick_cli_engine(args, target=None, draft=None, tp: int = 1):
    """"paged" or "decoder" for ``--engine`` and the options given (api.pick_engine, tilespec.generate's rule);
    without models: the choice where the options alone decide it, else None."""
    options = dict(gamma=args.gamma, gamma_schedule=args.gamma_schedule, method=args.method,
                   compile=bool(args.compile), sampling=sampling_from_args(args), **tree_options(args))
    if target is not None and draft is None and (options["tree"] or options["chains"]):
        draft = "head"      # as tree_decoder: trees without --draft are the target's head's
    return pick_engine(target, draft, args.engine, options, tp, fix="use --engine decoder")


def tree_options(args) -> dict:
    """tree= / chains= / scheme= from ``--tree`` / ``--chains K,L`` / ``--scheme`` (None where not given)."""
    chains = getattr(args, "chains", None)
    if chains:
        try:
            chains = tuple(int(x) for x in chains.split(","))
        except ValueError:
            raise ValueError(f"--chains expects K,L (chains, tokens per chain), got {chains!r}") from None
    return dict(tree=tree_option(args), chains=chains or None, scheme=getattr(args, "scheme", None))


def build_engine(choice: str, args, target, draft, tok, prompts):
    """The engine ``choice`` names with the decoding arguments: SpeculativeDecoder, or the paged engine behind its
    interface (api.make_paged: sized to ``prompts``)."""
    if choice == "paged":
        trees = tree_options(args)
        if draft is None and (trees["tree"] or trees["chains"]):
            draft = "head"
        return make_paged(target, draft, tok, dict(gamma=args.gamma, method=args.method, compile=args.compile,
                                                   sampling=sampling_from_args(args), **trees),
                          prompts, args.max_new_tokens)
    from tilespec.engine import SpeculativeDecoder
    return SpeculativeDecoder(target, draft, gamma=args.gamma, gamma_schedule=args.gamma_schedule,
                              method=args.method, sampling=sampling_from_args(args), tokenizer=tok,
                              compile=args.compile)


def sampling_from_args(args):
    from tilespec.verify import SamplingParams
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def stats_rows(stats) -> list:
    """(label, value) rows of a RunStats, formatted."""
    t = stats.times
    rows = [("requests", f"{stats.requests}"), ("new tokens", f"{stats.new_tokens}"),
            ("tokens/s", f"{stats.tokens_per_second:.1f}"), ("target calls", f"{stats.target_calls}")]
    if stats.drafted:
        rows += [("acceptance rate α (accepted/drafted)", f"{stats.alpha:.3f}"),
                 ("tokens per target call (τ)", f"{stats.block_efficiency:.2f}")]
        if stats.gammas:        # the paged engine prices each step's drafts: no γ per step
            rows.append(("mean γ (all steps / speculative steps)",
                         f"{stats.mean_gamma:.2f} / {stats.mean_spec_gamma:.2f}"))
        rows.append(("verify method", stats.method))
    if stats.context_steps or stats.drafter in ("ngram", "suffix"):
        rows.insert(4, ("drafter", stats.drafter))
        rows.append(("steps with a context match", f"{100 * stats.match_share:.0f} % of request-steps"))
    if stats.fallback_at_step is not None:
        rows.append(("fallback to target-only", f"from step {stats.fallback_at_step} ({stats.fallback_steps} steps)"))
    for phase in ("prefill", "draft", "target", "verify", "bookkeeping"):
        if t.get(phase):
            rows.append((f"time {phase}", f"{t[phase]:.3f} s"))
    rows.append(("wall time", f"{stats.wall_time:.3f} s"))
    if t:                       # phase times: the decoder's
        rows.append(("verify share of step time", f"{100 * stats.verify_share:.1f} %"))
    rows += [("KV cache", f"{stats.kv_cache_bytes / 2**20:.1f} MiB"),
             ("peak memory", f"{stats.peak_memory_bytes / 2**20:.0f} MiB")]
    if stats.runtime.startswith("paged"):
        rows.insert(1, ("engine", "paged"))
    return rows


def print_stats(stats, title: str = "tilespec") -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title, show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    for k, v in stats_rows(stats):
        table.add_row(k, v)
    Console(stderr=True).print(table)


def stream_text(decoder, tok, prompt_ids, max_new_tokens, seed, out=None, **kw) -> list:
    """Run decoder.stream for one request, printing decoded text as it grows; returns the new tokens."""
    out = out or sys.stdout
    tokens, shown = [], ""
    for event in decoder.stream(prompt_ids, max_new_tokens=max_new_tokens, seed=seed, **kw):
        tokens += event.tokens.get(0, [])
        text = tok.decode(tokens, skip_special_tokens=True)
        if text.startswith(shown):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    out.write("\n")
    return tokens


def read_batch_file(path: Path) -> list:
    """One prompt per line, or JSON lines with a "prompt" (or "text"/"document") field."""
    if not path.is_file():
        raise FileNotFoundError(f"batch file not found: {path}")
    prompts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            row = json.loads(line)
            prompts.append(next(str(row[k]) for k in ("prompt", "text", "document") if k in row))
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"batch file {path} holds no prompts")
    return prompts


def run(args) -> int:
    import torch
    if args.prompt is None and args.batch_file is None:
        raise ValueError("give --prompt TEXT or --batch-file FILE")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("--prompt is empty: give some text to continue")
    check_decoding_args(args)
    if tree_option(args) is not None and args.chains:     # tree options fail here, before a model loads
        raise ValueError("give --tree or --chains, not both")
    choice = pick_cli_engine(args, tp=args.tp)      # what the options decide fails before a model loads
    texts = [args.prompt] if args.prompt is not None else read_batch_file(args.batch_file)
    tp = None
    if args.tp > 1:     # under torchrun: one process per GPU, the target sharded, rank 0 prints
        from tilespec.engine.native.tensor_parallel import init_tensor_parallel
        tp = init_tensor_parallel(args.tp)
    main = tp is None or tp.main
    device = tp.device if tp is not None else pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    log = (lambda m: print(m, file=sys.stderr)) if main else (lambda m: None)  # noqa: E731
    extra = {"tp": tp, "tp_check": args.tp_check or None} if tp is not None else {}
    target, draft, tok = load_pair(args.target, args.draft, device, dtype, log=log, **extra)
    ids = encode_prompts(tok, texts, not args.no_chat)
    choice = choice or pick_cli_engine(args, target, draft, args.tp)
    if (args.tree or args.chains) and choice != "paged":
        dec = tree_decoder(args, target, draft, tok, log=log)
    else:
        dec = build_engine(choice, args, target, draft, tok, ids)
    quiet = open(os.devnull, "w") if not main else None
    with torch.inference_mode():
        if len(ids) == 1:
            seqs = [stream_text(dec, tok, ids, args.max_new_tokens, args.seed, out=quiet)]
        else:
            seqs = dec.generate(ids, max_new_tokens=args.max_new_tokens, seed=args.seed).sequences
            for i, s in enumerate(seqs if main else []):
                print(f"--- [{i}] {texts[i][:60]!r}\n{tok.decode(s, skip_special_tokens=True)}")
    if tp is not None:
        from tilespec.engine.native.tensor_parallel import check_consistent
        check_consistent(target, seqs if args.tp_check else None)
        torch.distributed.destroy_process_group()
    if not main:
        return 0
    stats = dec.last_stats
    print_stats(stats, title=f"{args.target} + {args.draft or 'no draft'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "target": args.target, "draft": args.draft, "engine": choice, "prompts": texts,
            "outputs": [tok.decode(s, skip_special_tokens=True) for s in seqs], "tokens": seqs,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
            "tree": chosen_tree(dec), "stats": stats.to_dict()}, indent=2))
    return 0


def tree_decoder(args, target, draft, tok, log=None):
    """``--tree auto | N`` / ``--chains K,L``: the decoder verifying a token tree per step (docs/trees.md), drafted by
    the head (default), ``--draft ngram`` (context trees) or a draft model (chains); ``log`` gets the tree's shape."""
    from tilespec.engine.tree_decoder import TreeDecoder
    if args.tp > 1:
        raise ValueError("--tree / --chains run on one GPU (no --tp)")
    tree = tree_option(args)
    shape = {"tree": tree} if tree is not None else \
        {"chains": tuple(int(x) for x in args.chains.split(",")), "scheme": args.scheme}
    dec = TreeDecoder(target, draft if draft is not None else "head", sampling=sampling_from_args(args),
                      tokenizer=tok, compile=True if args.compile else "native", method=args.method, **shape)
    chosen = chosen_tree(dec)
    if chosen is not None and log is not None:
        log(describe(chosen, args.temperature))
    return dec


def register(sub) -> None:
    p = sub.add_parser("generate", help="speculative text generation with a target and a draft model")
    p.add_argument("--target", required=True, help="registry name, model folder, .gguf file or hub id")
    p.add_argument("--draft", default=None, help="draft: a model (e.g. NAME:layers=8), ngram, suffix (context drafting, "
                                                 "no model), MODEL+ngram, head / head+ngram (the target's trained head; "
                                                 "`tilespec draft train`), a head folder (omit for target-only)")
    p.add_argument("--prompt", default=None, help="prompt text")
    p.add_argument("--batch-file", type=Path, default=None, help="prompts, one per line (or JSON lines)")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="shard the target over N GPUs (tensor parallel); launch with torchrun --nproc-per-node N")
    p.add_argument("--tp-check", action="store_true",
                   help="with --tp: check that every rank sees and emits the same tokens (debug)")
    add_tree_arguments(p, "verify")
    p.add_argument("--chains", default=None, metavar="K,L",
                   help="verify K chains of L tokens sampled from the head or the draft model "
                        "(multi-draft (Khisti et al. 2024); --scheme)")
    p.add_argument("--scheme", default="specinfer", help="--chains: specinfer, spectr, is, is-lp, ... (sd for K=1)")
    add_engine_argument(p)
    add_decoding_arguments(p)
    p.set_defaults(func=run)
