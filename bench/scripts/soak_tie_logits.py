"""GPU diagnostic for a soak greedy divergence: the logits both paths saw at the first differing token.

Rebuilds the soak's model (``qwen_like``, random init, bf16) and prompts for one shape, decodes them greedily with
our runtime (``SpeculativeDecoder``, no draft, ``--compile``) and with transformers' ``generate`` (eager,
left-padded, ``output_logits``), and for every row that differs records at its first differing position j:

* ``ours``: the fp32 target logits our runtime took the argmax of at j. They are recorded in a second run on the
  host-commit path (a pass-through ``verify_fn`` turns the captured whole-step graphs off; the target runner and
  its forward are the same), whose ``HostExecution.argmax`` keeps a copy; ``recorded_run_same_tokens`` says whether
  that run emitted the same tokens as the plain one (if not, its logits are not the ones that diverged);
* ``transformers``: ``generate``'s logits at j;
* ``fp32``: an fp32 copy of the model scoring prompt + common prefix (no padding): the "true" order of the tokens;

each as fp32 values of the top 5 ids and of the two disputed ids (ours' pick and transformers'), with the gap
between the two in bf16 steps of the top logit and the tie rule's verdict (``greedy_ties``).

    python3 bench/scripts/soak_tie_logits.py --shape 16x64 --compile True --json tie-logits.json

Without a GPU it runs the soak's CPU toy (``--smoke``) to check the script itself.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from greedy_ties import TIE_STEPS, bf16_step, first_difference, top2_gaps  # noqa: E402


def _view(logits, disputed: list) -> dict:
    """fp32 logits [V] -> top-5 and the disputed ids' values, their gap in bf16 steps of the top logit."""
    import torch
    vals, ids = torch.topk(logits.float(), 5)
    a, b = (float(logits[t]) for t in disputed)
    return dict(top5=[[int(i), float(v)] for i, v in zip(ids, vals)], argmax=int(torch.argmax(logits)),
                disputed={str(t): float(logits[t]) for t in disputed},
                gap_bf16_steps=round(abs(a - b) / float(bf16_step(vals[:1])[0]), 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16x64", help="BxL: batch and prompt tokens (as soak.py's SHAPES)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--compile", default="True", help="the engine's compile mode: False, True, native, graphs, ...")
    ap.add_argument("--seed", type=int, default=0, help="the soak's round (generate seed; T = 0 ignores it)")
    ap.add_argument("--smoke", action="store_true", help="CPU toy model (checks the script, not the GPU)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    import torch
    from graphs_after_hf_static import qwen_like
    from soak import prompts
    from tilespec.engine import SpeculativeDecoder, execution
    from tilespec.engine.step import run_verify
    from tilespec.env import run_record
    from tilespec.verify import SamplingParams

    cuda = torch.cuda.is_available() and not args.smoke
    batch, length = (int(v) for v in args.shape.split("x"))
    mode = {"False": False, "True": True}.get(args.compile, args.compile) if cuda else False
    target = qwen_like(args.layers, device="cuda" if cuda else "cpu", small=not cuda)
    vocab = target.config.vocab_size
    ps = prompts(batch, length if cuda else min(length, 40), seed=batch + length, vocab=vocab)
    want, hf_logits = _hf_greedy(target, ps, args.new_tokens)                 # as soak.hf_greedy, with logits

    def decode(verify_fn=None):
        dec = SpeculativeDecoder(target, None, sampling=SamplingParams(temperature=0.0), compile=mode,
                                 eos_token_id=[], verify_fn=verify_fn)
        return dec.generate(ps, max_new_tokens=args.new_tokens, seed=args.seed).sequences

    got = decode()
    steps, argmax = [], execution.HostExecution.argmax

    def recording_argmax(logits):
        steps.append(logits.float().cpu())                                     # [B, V]: a greedy step without drafts
        return argmax(logits)
    execution.HostExecution.argmax = staticmethod(recording_argmax)
    try:
        recorded = decode(run_verify)                                          # host-commit path, same runner
    finally:
        execution.HostExecution.argmax = staticmethod(argmax)
    first_recorded = args.new_tokens - len(steps)                              # tokens produced before any argmax
    picks = [[int(t) for t in step.argmax(-1)] for step in steps]             # the recording's own argmax per step
    recorded_argmax = all(picks[j][r] == recorded[r][first_recorded + j] for j in range(len(steps))
                          for r in range(batch))
    fp32 = copy.deepcopy(target).float()
    rows = []
    for r in range(batch):
        j = first_difference(got[r], want[r])
        if j is None:
            continue
        disputed = [got[r][j], want[r][j]]
        row = dict(row=r, token=j, ours_picked=got[r][j], transformers_picked=want[r][j],
                   reference_gap_bf16_steps=round(top2_gaps(hf_logits[r:r + 1, j:j + 1])[0][0], 3),
                   transformers=_view(hf_logits[r, j], disputed))
        row["tie_rule"] = "tie" if row["reference_gap_bf16_steps"] <= TIE_STEPS else "FAIL"
        if j >= first_recorded and j - first_recorded < len(steps):
            row["ours"] = _view(steps[j - first_recorded][r], disputed)
        with torch.inference_mode():
            ids = torch.tensor([ps[r] + want[r][:j]], device=target.device)
            row["fp32"] = _view(fp32(ids).logits[0, -1], disputed)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rec = dict(run_record(target.device), script="bench/scripts/soak_tie_logits.py", shape=[batch, length],
               compile=str(mode), layers=args.layers, new_tokens=args.new_tokens, tie_steps=TIE_STEPS,
               recorded_run_same_tokens=recorded == got, recorded_logits_give_its_tokens=recorded_argmax,
               first_recorded_token=first_recorded,
               rows_differing=len(rows), rows=rows)
    Path(args.json).write_text(json.dumps(rec, indent=1))
    print(json.dumps({k: rec[k] for k in ("device", "rows_differing", "recorded_run_same_tokens",
                                          "recorded_logits_give_its_tokens")}))
    return 0


def _hf_greedy(model, batch: list, new_tokens: int):
    """transformers' greedy ``generate`` as ``soak.hf_greedy`` (left-padded, eager) -> (tokens per row, logits
    [B, steps, V] fp32 on the CPU)."""
    import torch
    width = max(map(len, batch))
    x = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[:, width:].tolist(), torch.stack(out.logits, dim=1).float().cpu()


if __name__ == "__main__":
    sys.exit(main())
