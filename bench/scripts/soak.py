"""GPU soak: one process, one loaded target, many generations of every kind, interleaved with transformers.

Each round runs the same list of generations, every (compile mode x drafter x temperature) ``--per-combination``
times, each on its own (batch size, prompt length) from ``SHAPES`` (1..16 rows, 1..8000 prompt tokens); between
compile modes it calls
transformers' ``generate`` (plain, then static cache: compiled with CUDA-graph trees on CUDA), and between rounds
``torch._dynamo.reset()``. Checks, all counted as failures in the JSON:
  * no exception (a CUDA fault would end the process: the JSON is rewritten after every generation, so a crash
    leaves the record of everything before it);
  * T = 0: every row equals transformers' own greedy ``generate`` of the same batch (eager, left-padded, computed
    once per shape), except at a bf16 tie: at the first differing position the top two logits of that reference
    forward (prompt + common prefix) are at most ``--tie-steps`` bf16 steps apart (``greedy_ties``: 2, the most
    that rounding both runs' logits to bf16 can move the gap); ties are counted apart and every divergence is
    recorded with its gap;
  * T = 1 (top-k 50, top-p 0.9): right number of tokens, every id in the vocabulary;
  * memory flat: ``torch.cuda.memory_allocated()`` after each round (cached runners and graphs included) may not
    grow by more than ``--memory-slack-mib`` over the second round (the first round builds every cache).

    python3 bench/scripts/soak.py --rounds 5 --json bench/results/soak-random-qwen2.5-1.5b-shaped-h200.json

The target is a random-init model with Qwen2.5-1.5B's shapes and ``--layers`` layers (bf16, a sharpened LM head;
bf16 ties are still frequent: every divergence is recorded with its gap); the draft model is its first layer.
``--budget-s`` stops at the first generation past it (the JSON says how many rounds and generations ran).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time

from greedy_ties import TIE_STEPS, judge, top2_gaps

MODES = (False, "native", True, "graphs", "compiled-graphs")
DRAFTERS = (None, "ngram", "suffix", "model")
# (batch, prompt tokens): generation i of a round uses SHAPES[i % len(SHAPES)]
SHAPES = ((1, 1), (1, 8000), (4, 300), (16, 64), (2, 2000), (8, 700), (1, 40), (3, 4000), (16, 500), (5, 129))


def draft_of(target, layers: int = 1):
    cfg = target.config.to_dict()
    cfg["num_hidden_layers"] = layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    draft = type(target)(type(target.config)(**cfg)).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.to(target.device, target.dtype)


def prompts(batch: int, length: int, seed: int, vocab: int = 151936) -> list:
    """``batch`` prompts of ``length`` .. ``length`` - 3 tokens (ragged), a random phrase repeated so that context
    drafters find matches."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in range(batch):
        n = max(1, length - (r % 4))
        phrase = torch.randint(vocab // 100, vocab - 10, (min(n, 37),), generator=g).tolist()
        out.append((phrase * (n // len(phrase) + 1))[:n])
    return out


def hf_greedy(model, batch: list, new_tokens: int) -> tuple[list, list]:
    """transformers' own target-only greedy decoding of ``batch`` (left-padded, eager) -> (tokens per row, and per
    row and step the top logit and the gap to the second, in bf16 steps of the top logit: the tie rule's input)."""
    import torch
    width = max(map(len, batch))
    x = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, dim=1).float()                  # [B, steps, V]
    return out.sequences[:, width:].tolist(), top2_gaps(logits)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-combination", type=int, default=2,
                    help="generations per (mode, drafter, temperature) and round, on consecutive shapes")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--budget-s", type=float, default=0.0, help="stop after the round crossing this (0: none)")
    ap.add_argument("--modes", default=",".join(str(m) for m in MODES))
    ap.add_argument("--memory-slack-mib", type=float, default=64.0)
    ap.add_argument("--tie-steps", type=float, default=TIE_STEPS,
                    help="a T=0 difference is a tie when the target's top two logits there are at most this many "
                         "bf16 steps apart (greedy_ties.py says why 2)")
    ap.add_argument("--shapes", default=None, help="override SHAPES: 'BxL,BxL,...' (e.g. 16x64,1x8000)")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated subset of 0,1")
    ap.add_argument("--no-hf", action="store_true", help="skip the interleaved transformers generate calls")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: a toy model, short prompts, eager modes")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    import torch
    from tilespec.engine import SpeculativeDecoder
    from tilespec.env import run_record
    from tilespec.verify import SamplingParams
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from graphs_after_hf_static import qwen_like

    modes = [{"False": False, "True": True}.get(m, m) for m in args.modes.split(",")]
    cuda = torch.cuda.is_available() and not args.smoke
    shapes = SHAPES if not args.shapes else tuple(tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(","))
    shapes = shapes if not args.smoke else tuple((b, min(n, 40)) for b, n in shapes)
    temperatures = tuple(float(t) for t in args.temperatures.split(","))
    t_start = time.perf_counter()
    target = qwen_like(args.layers, device="cuda" if cuda else "cpu", small=args.smoke)
    draft = draft_of(target)
    vocab = target.config.vocab_size
    rec = dict(run_record(target.device), script="bench/scripts/soak.py",
               model=f"random-init Qwen2.5-1.5B shapes, {args.layers} layers, bf16" if not args.smoke else "toy",
               rounds_planned=args.rounds,
               new_tokens=args.new_tokens, modes=[str(m) for m in modes], drafters=[str(d) for d in DRAFTERS],
               shapes=shapes, generations=[], hf_generations=0, failures=[], ties=0, memory_after_round_mib=[])
    reference: dict = {}

    def save():
        rec["seconds"] = round(time.perf_counter() - t_start, 1)
        rec["n_generations"] = len(rec["generations"])
        rec["n_failures"] = len(rec["failures"])
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)

    def target_only(shape):
        if shape not in reference:
            reference[shape] = hf_greedy(target, prompts(*shape, seed=sum(shape), vocab=vocab), args.new_tokens)
        return reference[shape]

    def hf_generate(static: bool):
        x = torch.tensor([prompts(1, 64, seed=5, vocab=vocab)[0]], device=target.device)
        kw = dict(cache_implementation="static") if static else {}
        try:
            target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                            pad_token_id=0, **kw)
        except Exception as err:
            rec["failures"].append(dict(hf_static=static, problems=[f"{type(err).__name__}: {err}"[:500]]))
        rec["hf_generations"] += 1

    for rnd in range(args.rounds):
        i = 0
        for mode in modes:
            for static in (False, True) if not args.no_hf else ():
                hf_generate(static)
            for drafter, temp, _ in itertools.product(DRAFTERS, temperatures, range(args.per_combination)):
                if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                    break
                shape = shapes[i % len(shapes)]
                i += 1
                entry = dict(round=rnd, mode=str(mode), drafter=str(drafter), temperature=temp, batch=shape[0],
                             prompt_tokens=shape[1])
                sampling = SamplingParams(temperature=temp, top_k=50 if temp else 0, top_p=0.9 if temp else 1.0)
                d = draft if drafter == "model" else drafter
                t0 = time.perf_counter()
                try:
                    dec = SpeculativeDecoder(target, d, gamma=3, sampling=sampling, compile=mode,
                                             eos_token_id=[])
                    ps = prompts(*shape, seed=sum(shape), vocab=vocab)
                    seqs = dec.generate(ps, max_new_tokens=args.new_tokens, seed=rnd).sequences
                    if cuda:
                        torch.cuda.synchronize()
                    problems = []
                    if any(len(s) != args.new_tokens or min(s) < 0 or max(s) >= vocab for s in seqs):
                        problems.append("wrong length or token id out of range")
                    if temp == 0 and not problems:
                        want_rows, gaps = target_only(shape)
                        divergences, ties, bad = judge(seqs, want_rows, gaps, args.tie_steps)
                        if divergences:
                            entry["divergences"] = divergences
                        rec["ties"] += ties
                        problems += bad
                    entry["ok"] = not problems
                    if problems:
                        rec["failures"].append(dict(entry, problems=problems))
                except Exception as err:      # a Python-level failure is recorded; a CUDA fault ends the process
                    entry["ok"] = False
                    rec["failures"].append(dict(entry, problems=[f"{type(err).__name__}: {err}"[:500]]))
                entry["seconds"] = round(time.perf_counter() - t0, 3)
                rec["generations"].append(entry)
                save()
            if mode == "compiled-graphs":    # give the next transformers generate its own modules back
                from tilespec.engine.runner import uncompile_decoder_layers
                uncompile_decoder_layers(target)
                uncompile_decoder_layers(draft)
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            rec["memory_after_round_mib"].append(round(torch.cuda.memory_allocated() / 2**20, 1))
        rec["rounds_done"] = rnd + 1
        save()
        if args.budget_s and time.perf_counter() - t_start > args.budget_s:
            break
        torch._dynamo.reset()
        rec["dynamo_resets"] = rec.get("dynamo_resets", 0) + 1
    mem = rec["memory_after_round_mib"]
    if len(mem) >= 3 and max(mem[1:]) - mem[1] > args.memory_slack_mib:
        rec["failures"].append(dict(problems=[f"memory grew after the second round: {mem} MiB"]))
    rec["memory_flat"] = len(mem) < 3 or max(mem[1:]) - mem[1] <= args.memory_slack_mib
    save()
    print(json.dumps({k: rec[k] for k in ("n_generations", "hf_generations", "n_failures", "ties", "seconds",
                                          "memory_after_round_mib")}), flush=True)
    for f in rec["failures"][:20]:
        print("FAILURE", json.dumps(f), flush=True)
    return 0 if not rec["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
