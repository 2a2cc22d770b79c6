"""Tree vs chain with one draft head, and the multi-draft schemes (Khisti et al. 2024), on the fast runtime (B = 1).

Systems per temperature (each prompt: one untimed warm-up run, then the timed run; tok/s = new tokens / wall time):
  ar                       target-only (SpeculativeDecoder without a draft)
  chain-g<G>               the head drafting a chain of G tokens (SpeculativeDecoder, draft="head")
  tree-<b>-<d>-<n>         the head's EAGLE-2-style dynamic tree (SpeculativeDecoder, tree=(b, d, n))
  tree-auto                (--auto) the head's tree shaped from its stored per-depth acceptance at the row's T
                           (tree="auto", drafters/tree_choice.py; the default (8, 6, 32) when the head stores none)
  ngram-g<G> / ctx-<m>-<l>-<n>   context drafting: one n-gram match as a chain / m matches as a tree (T = 0, 1)
  md-K<K>-L<L>-<scheme>    K chains of L tokens sampled from the head at --draft-temperature (T > 0 only), selected
                           with sd (K = 1), specinfer, spectr or is (SpeculativeDecoder, chains=(K, L))
  mdm-K<K>-L<L>-<scheme>   the same with the draft MODEL --md-draft (the paper's setting; skipped if it cannot load)
Every row records tau (tokens per target forward), tok/s, and the speedups over ar and over the chain; at T = 0
the fraction of requests whose tokens equal target-only's (bf16 forwards of different shapes may differ); tree rows
record the tree drafted ("tree": branch, depth, nodes, auto, source = given / alpha_by_temperature / default).

GPU (after `run.sh e2e heads-train`):  python bench/scripts/trees.py --xsum-wheel W --stage t0 --auto --json OUT.json
CPU smoke test (tiny random target and head):  python bench/scripts/trees.py --tiny --prompts 2 --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tilespec.bench.e2e import add_arguments, environment, load_models, prompt_ids
from tilespec.bench.tree_args import chosen_tree
from tilespec.engine import SpeculativeDecoder
from tilespec.engine.drafters import HeadDrafter
from tilespec.verify import SamplingParams

STAGES = {"t0": ([0.0], False), "t1": ([1.0], False), "md": ([1.0], True)}


def _triples(text: str) -> list:
    return [tuple(int(x) for x in part.split(",")) for part in text.split(";") if part.strip()]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.set_defaults(draft="", task="xsum", batch_sizes=[1], compile="auto", methods=["fused"], ignore_eos=True)
    ap.add_argument("--stage", choices=sorted(STAGES), default=None,
                    help="t0 / t1: ar, chain, trees at T = 0 / 1; md: the multi-draft schemes at T = 1 "
                         "(default: --temperature with trees, and the schemes where T > 0)")
    ap.add_argument("--head", default="head", help="the head: 'head' (the target's trained head) or a folder")
    ap.add_argument("--chain-gamma", type=int, default=4, help="the chain's draft length")
    ap.add_argument("--trees", type=_triples, default=[(8, 6, 32), (10, 6, 48)],
                    help="';'-separated branch,depth,nodes of the dynamic trees")
    ap.add_argument("--auto", action="store_true",
                    help="also a tree-auto row per temperature (t0 / t1; md has no tree rows): tree='auto', the shape "
                         "chosen from the head's stored per-depth acceptance at that temperature, recorded in the row")
    ap.add_argument("--context-trees", type=_triples, default=[(4, 6, 16)],
                    help="';'-separated matches,length,nodes of context trees (with an ngram chain; '' = none)")
    ap.add_argument("--chains", type=_triples, default=[(1, 5), (2, 5), (4, 5)], help="';'-separated K,L")
    ap.add_argument("--schemes", default="specinfer,spectr,is", help="schemes for K >= 2 (K = 1 is sd)")
    ap.add_argument("--draft-temperature", type=float, default=1.2, help="the sampled chains' draft temperature")
    ap.add_argument("--md-draft", default="qwen2.5-coder-0.5b-instruct",
                    help="draft model of the mdm-* rows ('' = none; --tiny: a 1-layer copy of the target)")
    return ap.parse_args(argv)


def _head(args, target):
    if args.tiny:    # a random head on the tiny target (smoke test: tokens are exact, acceptance is low)
        from tilespec.heads import DraftHead, config_for
        head = DraftHead(config_for(target)).init_from(target).to(next(target.parameters()).device)
        return HeadDrafter(head.to(next(target.parameters()).dtype).bind(target).eval().requires_grad_(False))
    return HeadDrafter() if args.head == "head" else HeadDrafter(args.head)


def _systems(args, temps, multidraft):
    out = []
    for temp in temps:
        if not multidraft:
            out += [(temp, "ar", None), (temp, f"chain-g{args.chain_gamma}", None)]
            out += [(temp, "tree-auto", {"tree": "auto"})] if args.auto else []   # before the fixed ones (budget)
            out += [(temp, "tree-%d-%d-%d" % t, {"tree": t}) for t in args.trees]
            if args.context_trees:
                out += [(temp, f"ngram-g{args.chain_gamma}", None)]
                out += [(temp, "ctx-%d-%d-%d" % t, {"tree": t, "draft": "ngram"}) for t in args.context_trees]
        if multidraft and temp > 0:
            out.append((temp, "ar", None))
            for prefix, extra in (("mdm", {"draft": "model"}), ("md", {})):     # the paper's setting first
                if prefix == "mdm" and not args.md_draft:
                    continue
                for k, length in args.chains:
                    for scheme in (["sd"] if k == 1 else args.schemes.split(",")):
                        out.append((temp, f"{prefix}-K{k}-L{length}-{scheme}",
                                    {"chains": (k, length), "scheme": scheme, **extra}))
    return out


def _draft_model(args, target, device, dtype):
    """The mdm-* rows' draft model (cached on ``args``), or the reason it could not be loaded."""
    if not hasattr(args, "_md_model"):
        try:
            if args.tiny:
                from transformers import Qwen2ForCausalLM
                cfg = target.config.to_dict()
                cfg["num_hidden_layers"] = 1
                cfg.pop("layer_types", None)
                model = Qwen2ForCausalLM(type(target.config)(**cfg)).to(device=device, dtype=dtype).eval()
                model.load_state_dict(target.state_dict(), strict=False)
            else:
                from tilespec.api import load
                model, _ = load(args.md_draft, role="draft", device=device, dtype=dtype)
            args._md_model = model
        except Exception as err:      # e.g. its weights are not on this machine: the head's rows still run
            args._md_model = f"{type(err).__name__}: {err}"
    return args._md_model


def _decoder(args, system, cfg, target, drafter, tok, sampling, compile):
    eos = {"eos_token_id": []} if args.ignore_eos else {}
    uses_head = system.startswith(("chain", "tree", "md-"))
    if uses_head and isinstance(drafter, str):
        raise RuntimeError(f"the head could not be loaded: {drafter}")
    if system == "ar":
        return SpeculativeDecoder(target, None, sampling=sampling, tokenizer=tok, compile=compile, **eos)
    if system.startswith(("chain", "ngram")):
        return SpeculativeDecoder(target, drafter if system.startswith("chain") else "ngram", gamma=args.chain_gamma,
                                  sampling=sampling, tokenizer=tok, compile=compile, method=args.methods[0], **eos)
    cfg = dict(cfg)
    draft = cfg.pop("draft", drafter)
    if draft == "model":
        p = next(target.parameters())
        draft = _draft_model(args, target, p.device, p.dtype)
        if isinstance(draft, str):
            raise RuntimeError(f"draft model {args.md_draft!r} not loaded: {draft}")
    draft_sampling = SamplingParams(temperature=args.draft_temperature) if "chains" in cfg else None
    return SpeculativeDecoder(target, draft, sampling=sampling, tokenizer=tok, compile=compile,
                              draft_sampling=draft_sampling, **cfg, **eos)


def _run_one(dec, ids, args, seed):
    out = dec.generate([ids], max_new_tokens=args.max_new_tokens, seed=seed)
    s = out.stats
    return out.sequences[0], s.new_tokens, s.target_calls, s.wall_time, s.accepted_histogram


def main(argv=None) -> int:
    args = parse(argv)
    temps, multidraft = STAGES[args.stage] if args.stage else (args.temperatures, None)
    device = torch.device("cuda" if torch.cuda.is_available() and args.device in ("auto", "cuda") else "cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
             "float32": torch.float32, "float16": torch.float16}[args.dtype]
    compile = True if args.compile == "auto" else args.compile
    target, _, tok = load_models(args, device, dtype)
    try:
        drafter = _head(args, target)
        drafter.attach(target)
    except Exception as err:     # no trained head here: the rows without it (ar, ngram, ctx, mdm) still run
        drafter = f"{type(err).__name__}: {err}"
        print(f"no head: {drafter}", file=sys.stderr)
    prompts = prompt_ids(args, args.task.split(",")[0], tok, target.config.vocab_size)
    systems = [] if multidraft else _systems(args, temps, False)
    systems += _systems(args, temps, True) if multidraft in (None, True) else []
    seen: set = set()
    systems = [x for x in systems if not ((x[0], x[1]) in seen or seen.add((x[0], x[1])))]   # one ar per T
    record = {"benchmark": "trees", "env": environment(device), "settings": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "rows": []}
    path = args.out or Path(f"trees-{args.target.split('/')[-1]}-{device.type}.json")
    done = _resume(path, record)
    ar_tokens: dict = {}
    t_start = time.perf_counter()
    for temp, system, cfg in systems:
        if (system, temp) in done:
            continue
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            print(f"budget: {system} at T={temp} skipped", file=sys.stderr)
            continue
        sampling = SamplingParams(temperature=temp)
        row = {"system": system, "temperature": temp, "batch_size": 1, "prompts": 0, "new_tokens": 0,
               "target_calls": 0, "wall_time": 0.0, "same_as_ar": 0, "compared_with_ar": 0}
        try:
            dec = _decoder(args, system, cfg or {}, target, drafter, tok, sampling, compile)
            t_sys = time.perf_counter()
            for i, ids in enumerate(prompts):
                for _ in range(args.warmup):
                    _run_one(dec, ids, args, seed=i)
                seq, new, calls, wall, hist = _run_one(dec, ids, args, seed=i)
                if hist is not None:    # request-steps per accepted length, summed over the prompts
                    acc = row.setdefault("accepted_histogram", [])
                    acc.extend([0] * (len(hist) - len(acc)))
                    for j, c in enumerate(hist):
                        acc[j] += c
                row["prompts"] += 1
                row["new_tokens"] += new
                row["target_calls"] += calls
                row["wall_time"] += wall
                if system == "ar":
                    ar_tokens[temp, i] = seq
                elif temp == 0 and (temp, i) in ar_tokens:
                    row["same_as_ar"] += int(ar_tokens[temp, i] == seq)
                    row["compared_with_ar"] += 1
                if args.max_seconds and time.perf_counter() - t_sys > args.max_seconds:
                    break
            row["graphed"] = dec.last_stats.graphed_steps > 0     # whole-step graphs (dynamic trees, chains)
            if chosen_tree(dec) is not None:     # the tree drafted (an auto one: chosen at this temperature)
                row["tree"] = chosen_tree(dec)
        except Exception as err:     # one failing system must not lose the others' numbers
            row["error"] = f"{type(err).__name__}: {err}"
            print(f"{system} T={temp}: FAILED {row['error']}", file=sys.stderr)
        row["tokens_per_second"] = row["new_tokens"] / row["wall_time"] if row["wall_time"] else None
        row["tau"] = row["new_tokens"] / row["target_calls"] if row["target_calls"] else None
        record["rows"].append(row)
        _compare(record["rows"])
        path.write_text(json.dumps(record, indent=1))
        tps = row["tokens_per_second"]
        shape = row.get("tree") if system == "tree-auto" else None
        print(f"T={temp} {system:28s} tau {row['tau'] or 0:5.2f}  tok/s {tps or 0:8.1f}  "
              f"{row.get('speedup_vs_chain') or 0:5.2f}x chain  {row.get('speedup_vs_ar') or 0:5.2f}x ar"
              + (f"  ({shape['branch']}, {shape['depth']}, {shape['nodes']}) from {shape['source']}" if shape else ""),
              flush=True)
    return 0


RESUME_KEYS = ("target", "task", "num_prompts", "max_new_tokens", "draft_temperature", "chain_gamma", "ignore_eos",
               "tiny", "stage")


def _resume(path: Path, record: dict) -> set:
    """A rerun with the same settings keeps the rows already measured (those without an error) -> their
    (system, temperature) keys."""
    if not path.is_file():
        return set()
    try:
        old = json.loads(path.read_text())
    except ValueError:
        return set()
    if any(old.get("settings", {}).get(k) != record["settings"].get(k) for k in RESUME_KEYS):
        return set()
    keep = [r for r in old.get("rows", []) if not r.get("error") and r.get("prompts")]
    record["rows"] = keep
    print(f"resuming {path}: {len(keep)} rows kept", file=sys.stderr)
    return {(r["system"], r["temperature"]) for r in keep}


def _compare(rows: list) -> None:
    """speedup_vs_ar / speedup_vs_chain and tau_vs_chain for every row with a baseline at its temperature; context
    trees against the ngram chain, sampled chains against their K = 1 (sd) row."""
    for r in rows:
        for name, key in (("ar", "speedup_vs_ar"), ("chain", "speedup_vs_chain")):
            base = next((b for b in rows if b["temperature"] == r["temperature"] and b["system"].startswith(name)
                         and b.get("tokens_per_second")), None)
            if base is not None and r.get("tokens_per_second"):
                r[key] = r["tokens_per_second"] / base["tokens_per_second"]
                if name == "chain" and r.get("tau") and base.get("tau"):
                    r["tau_vs_chain"] = r["tau"] / base["tau"]
        ngram = next((b for b in rows if b["temperature"] == r["temperature"] and b["system"].startswith("ngram")
                      and b.get("tokens_per_second")), None)
        if ngram is not None and r["system"].startswith("ctx-") and r.get("tokens_per_second"):
            r["speedup_vs_ngram"] = r["tokens_per_second"] / ngram["tokens_per_second"]
            r["tau_vs_ngram"] = r["tau"] / ngram["tau"] if r.get("tau") and ngram.get("tau") else None
        family = r["system"].split("-")[0]
        sd = next((b for b in rows if b["temperature"] == r["temperature"] and b["system"].endswith("-sd")
                   and b["system"].startswith(family + "-") and b.get("tokens_per_second")), None)
        if sd is not None and family in ("md", "mdm") and r.get("tokens_per_second"):
            r["speedup_vs_sd"] = r["tokens_per_second"] / sd["tokens_per_second"]


if __name__ == "__main__":
    sys.exit(main())
