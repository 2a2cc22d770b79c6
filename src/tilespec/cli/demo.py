"""``tilespec demo``: the main job -- speculative generation with an embedded default pair on this machine.

Default: SmolLM2-135M-Instruct as the target and its own first layers as a layer-skip draft (fits any CPU; the
weights are fetched on first use with a progress bar). Prints the streamed text, the acceptance statistics, and
checks that the greedy speculative output equals the target's own greedy output (transformers ``generate``).
"""
from __future__ import annotations

import time

from .generate import (encode_prompts, load_pair, pick_device, pick_dtype, print_stats, sampling_from_args,
                       stream_text)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_GPU_PAIR = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
DEFAULT_PROMPT = "Explain in three sentences why the sky is blue."


def run(args) -> int:
    import torch
    from rich.console import Console
    from tilespec.engine import SpeculativeDecoder

    console = Console(stderr=True)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    target_name = args.target or (DEFAULT_GPU_PAIR[0] if device.type == "cuda" else DEFAULT_MODEL)
    draft_name = args.draft or (DEFAULT_GPU_PAIR[1] if device.type == "cuda" and not args.target
                                else f"{target_name}:layers={args.layers}")
    console.print(f"[bold]tilespec demo[/bold]: target [cyan]{target_name}[/cyan], draft [cyan]{draft_name}[/cyan], "
                  f"{device}, {str(dtype).replace('torch.', '')}, γ={args.gamma} ({args.gamma_schedule}), "
                  f"verify={args.method}")
    target, draft, tok = load_pair(target_name, draft_name, device, dtype, log=console.print)
    dec = SpeculativeDecoder(target, draft, gamma=args.gamma, gamma_schedule=args.gamma_schedule,
                             method=args.method, sampling=sampling_from_args(args), tokenizer=tok,
                             compile=args.compile)
    ids = encode_prompts(tok, [args.prompt], True)
    console.print(f"[bold]prompt[/bold]: {args.prompt}\n[bold]speculative output[/bold]:")
    with torch.inference_mode():
        spec_tokens = stream_text(dec, tok, ids, args.max_new_tokens, args.seed)
    stats = dec.last_stats
    print_stats(stats, title="speculative decoding")
    if args.temperature != 0:
        console.print("sampling (temperature > 0): outputs follow the target's law; the token-for-token check "
                      "applies to greedy decoding only (use --temperature 0).")
        return 0
    console.print("checking against the target alone (transformers generate, greedy) ...")
    with torch.inference_mode():
        t0 = time.perf_counter()
        ref = target.generate(torch.tensor(ids, device=device), attention_mask=torch.ones(1, len(ids[0]),
                              dtype=torch.long, device=device), max_new_tokens=args.max_new_tokens,
                              do_sample=False, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        hf_time = time.perf_counter() - t0
    ref_tokens = ref[0, len(ids[0]):].tolist()
    n = len(spec_tokens)
    same = spec_tokens == ref_tokens[:n] and (n == len(ref_tokens) or n == args.max_new_tokens)
    hf_rate = len(ref_tokens) / hf_time if hf_time > 0 else float("nan")
    console.print(f"target-only greedy (transformers): {len(ref_tokens)} tokens, {hf_rate:.1f} tokens/s; "
                  f"speculative: {stats.tokens_per_second:.1f} tokens/s "
                  f"(α = {stats.alpha:.2f}, {stats.block_efficiency:.2f} tokens per target call)")
    if draft is not None and getattr(draft, "tilespec_layerskip", None) and stats.alpha < 0.3:
        console.print("note: an untrained layer-skip draft of a small model agrees rarely with it, so this pair "
                      "shows exactness rather than speed; try --target/--draft with a real draft model "
                      "(e.g. the Qwen2.5-Coder 1.5B/0.5B pair) for a speedup.")
    if same:
        console.print(f"[bold green]✓ greedy speculative output equals the target's greedy output "
                      f"({n} tokens, token for token)[/bold green]")
        return 0
    first = next((i for i, (a, b) in enumerate(zip(spec_tokens, ref_tokens)) if a != b), min(n, len(ref_tokens)))
    console.print(f"[bold red]✗ outputs differ at token {first}[/bold red] (with bf16/fp16 on GPU, batched "
                  f"and single-token forwards may round differently; fp32 on CPU must match exactly)")
    return 1


def register(sub) -> None:
    p = sub.add_parser("demo", help="speculative decoding on an embedded default model (fetched on first use)")
    p.add_argument("--target", default=None, help=f"target model (default {DEFAULT_MODEL} on CPU, "
                                                  f"{DEFAULT_GPU_PAIR[0]} on GPU)")
    p.add_argument("--draft", default=None, help="draft model (default: layer-skip of the target on CPU)")
    p.add_argument("--layers", type=int, default=26, help="decoder layers of the default layer-skip draft")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    from .generate import add_decoding_arguments
    add_decoding_arguments(p)
    p.set_defaults(max_new_tokens=64, gamma=3, func=run)
