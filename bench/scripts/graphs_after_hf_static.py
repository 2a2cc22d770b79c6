"""GPU check: our captured decoding stays correct after transformers' static-cache ``generate`` in the same process.

transformers compiles the decode forward of ``generate(cache_implementation="static")`` with
``mode="reduce-overhead"``; torch's CUDA-graph trees then free every cuBLAS workspace around each warm-up and
recording (``torch._C._cuda_clearCublasWorkspaces``). Graphs we captured earlier bake in the workspace address of
their capture stream, so replaying them afterwards writes into freed memory (engine/graphs.py). The sequence here
is the one that crashed ``tilespec bench e2e ... --systems ar,hf-static``: our target-only decoding (captures), HF's
static-compiled generate, then our decoding again at the same and at a new (longer) prompt length. Between the two,
the freed memory is handed to sentinel tensors: a replay that writes there changes them (or, where the memory went
back to the driver, dies with an illegal memory access).

    python3 bench/scripts/graphs_after_hf_static.py --json out.json            # with the fix (recapture)
    python3 bench/scripts/graphs_after_hf_static.py --no-recapture --json ...  # the old behaviour, to reproduce

Model: a random-init model with Qwen2.5-1.5B's shapes (hidden 1536, 12/2 heads, MLP 8960, vocab 151,936), ``--layers``
layers, bf16. Prints one JSON line; exit status 0 when outputs and sentinels are intact.
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def qwen_like(layers: int, seed: int = 0, device: str = "cuda", small: bool = False):
    """Random init, Qwen2.5-1.5B's shapes (``small``: a 64-wide, 1,000-token toy for CPU smoke runs)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    sizes = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4) if small else \
        dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_attention_heads=12)
    cfg = Qwen2Config(num_hidden_layers=layers, num_key_value_heads=2, max_position_embeddings=32768,
                      rope_theta=1e6, tie_word_embeddings=False, attn_implementation="sdpa", **sizes)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)      # sharper next-token laws: fewer bf16 near-ties between two runs
    return model.to(device, torch.bfloat16 if device == "cuda" else torch.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--short", type=int, default=700, help="prompt tokens of the first length")
    ap.add_argument("--long", type=int, default=3000, help="prompt tokens of the longer, new length")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-recapture", action="store_true",
                    help="disable the workspace watch (the behaviour before the fix), to reproduce the failure")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch
    from tilespec.engine import SpeculativeDecoder
    from tilespec.engine import graphs

    if args.no_recapture:        # undo the watch: caches never see a new epoch
        clear = torch._C._cuda_clearCublasWorkspaces
        torch._C._cuda_clearCublasWorkspaces = getattr(clear, "__wrapped__", clear)
        graphs._watch_workspace_clears = lambda: None
    t0 = time.perf_counter()
    model = qwen_like(args.layers)
    gen = torch.Generator().manual_seed(1)
    short = torch.randint(100, 150000, (args.short,), generator=gen).tolist()
    long = torch.randint(100, 150000, (args.long,), generator=gen).tolist()
    dec = SpeculativeDecoder(model, None, compile=True, eos_token_id=[])
    before = {n: dec.generate([p], max_new_tokens=args.new_tokens).sequences for n, p in (("short", short),)}
    eager = SpeculativeDecoder(model, None, compile="native", eos_token_id=[])
    expected = {n: eager.generate([p], max_new_tokens=args.new_tokens).sequences
                for n, p in (("short", short), ("long", long))}
    epoch0 = graphs._EPOCH[0]
    x = torch.tensor([short[:64]], device="cuda")
    for _ in range(3):           # warm-up, recording, replay of transformers' compiled decode
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    sentinels = [torch.full((1 << 20,), 7, dtype=torch.int32, device="cuda") for _ in range(256)]   # 1 GiB
    after = {}
    for n, p in (("short", short), ("long", long), ("short", short)):
        after[n] = dec.generate([p], max_new_tokens=args.new_tokens).sequences
    torch.cuda.synchronize()
    intact = all(bool(s.eq(7).all()) for s in sentinels)
    res = dict(script="graphs_after_hf_static", recapture=not args.no_recapture, layers=args.layers,
               short=args.short, long=args.long, clears_seen=graphs._EPOCH[0] - epoch0,
               same_as_before=after["short"] == before["short"],
               same_as_native_eager={n: after[n] == expected[n] for n in after},
               sentinels_intact=intact, seconds=round(time.perf_counter() - t0, 1),
               device=torch.cuda.get_device_name(), torch=torch.__version__)
    import transformers
    res["transformers"] = transformers.__version__
    res["ok"] = intact and res["same_as_before"]
    line = json.dumps(res)
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
