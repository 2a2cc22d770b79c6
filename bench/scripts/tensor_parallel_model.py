"""Shapes, byte counts and derived numbers for bench/scripts/tensor_parallel.py: random-init Qwen2.5 shapes built
from their configurations (no weights, no network), the bytes a rank reads per decode step (its weight shards and
its K/V heads), the copy bandwidth, a fixed-length context drafter, and the derived table (ratios to TP=1, the share
of the HBM floor, the sums' share of a step, the speculative step's cost and its projected speedups)."""
from __future__ import annotations

import time

import torch

VOCAB = 152064
SHAPES = {   # Qwen2.5 configs (hidden, MLP width, layers, heads, K/V heads); vocab 152,064, q/k/v biases, untied
    "7b": (3584, 18944, 28, 28, 4), "14b": (5120, 13824, 48, 40, 8), "32b": (5120, 27648, 64, 40, 8),
    "72b": (8192, 29568, 80, 64, 8),
    "tiny": (64, 128, 2, 8, 8),   # a CPU smoke test of the script (gloo); its heads divide 1, 2, 4 and 8
}


def qwen_config(shape: str):
    from transformers import Qwen2Config
    hidden, width, layers, heads, kv = SHAPES[shape]
    return Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=width, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)


def meta_model(shape: str, dtype=torch.bfloat16):
    """The transformers model on the meta device (shapes only, no memory), with a real RoPE table. ``shard()`` turns
    it into this rank's random shards on its GPU: no rank ever holds the full model, in host or device memory."""
    from transformers import Qwen2ForCausalLM
    cfg = qwen_config(shape)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg).to(dtype).eval()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    return model


def random_model(shape: str, device, dtype=torch.bfloat16):
    """The full model on ``device`` with random weights (N(0, 0.02); norms 1): the TP=1 baseline. MemoryError (before
    allocating) when its weights exceed 90 % of the device's memory (72B on one GPU)."""
    need = weight_bytes(shape, dtype_bytes=torch.empty((), dtype=dtype).element_size()) + VOCAB * SHAPES[shape][0] * 2
    if device.type == "cuda" and need > 0.9 * torch.cuda.get_device_properties(device).total_memory:
        raise MemoryError(f"{shape} needs {need / 2**30:.0f} GiB of weights: it does not fit one GPU (run it at TP > 1)")
    model = meta_model(shape, dtype).to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)   # to_empty left garbage
    return model


def weight_bytes(shape: str, tp: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of the weights one decode step reads on one rank of ``tp``: its shards of every layer's projections
    (q/k/v with biases, o, gate/up, down) and of the LM head (vocabulary padded to a multiple of tp), and the
    replicated norms. The embedding row read per token is negligible and not counted."""
    hidden, width, layers, heads, kv = SHAPES[shape]
    d = hidden // heads
    sharded = hidden * (heads + 2 * kv) * d + (heads + 2 * kv) * d + heads * d * hidden + 3 * width * hidden
    vocab = VOCAB + (-VOCAB % tp)
    return dtype_bytes * (layers * (sharded // tp + 2 * hidden) + hidden + vocab // tp * hidden)


def kv_bytes(shape: str, tp: int, batch: int, context: float, dtype_bytes: int = 2) -> float:
    """Bytes of K/V one decode step reads on one rank: its H_kv / tp heads of every layer over ``context`` positions
    for each of ``batch`` rows."""
    hidden, _, layers, heads, kv = SHAPES[shape]
    return dtype_bytes * batch * layers * 2 * (kv // tp) * (hidden // heads) * context


def copy_bandwidth(device) -> float:
    """Device-to-device copy of 2 GiB (16 MiB on CPU), bytes read + written per second (median of 10)."""
    n = 2**30 // 2 if device.type == "cuda" else 2**23
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for i in range(13):
        sync()
        t = time.perf_counter()
        b.copy_(a)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t)
    del a, b
    return 2 * n * 2 / sorted(times)[len(times) // 2]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class FixedDrafts:
    """A context drafter that proposes K copies of the last token every step (host-side, no model, like ngram):
    with random weights nothing is accepted, so every step verifies K + 1 tokens per row and emits one."""

    def __new__(cls, k: int):
        from tilespec.engine.drafters import ContextDrafter, ContextState

        class State(ContextState):
            def __init__(self, prompts):
                self.last = [p[-1] for p in prompts]

            def extend(self, row, tokens):
                if len(tokens):
                    self.last[row] = int(tokens[-1])

            def propose(self, row, cap):
                return [self.last[row]] * min(cap, k)

        class Fixed(ContextDrafter):
            kind = f"fixed-{k}"

            def start(self, prompts):
                return State(prompts)

        return Fixed()


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step emits on average with K drafts each accepted with probability α independently:
    (1 - α^(K+1)) / (1 - α)."""
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def _key(r: dict) -> tuple:
    return r["shape"], r["tp"], r.get("batch", 1), r.get("allreduce")


def derive(items: list, alphas: list) -> dict:
    """Derived numbers from the measured items: each TP>1 row's ratio to TP=1 (same shape and batch), the sums'
    share of a step (against the same row run with the collectives dropped), and each speculative row's step cost
    against the plain row, with its projected speedup for each α (marked ``projection``)."""
    done = [r for r in items if "per_step_ms" in r]
    plain = {_key(r): r for r in done if r.get("kind") == "plain"}
    out: dict = {"ratio_to_tp1": {}, "allreduce_share": {}, "spec_step": {}}
    for key, r in plain.items():
        base = plain.get((key[0], 1, key[2], None))
        name = f"{key[0]} tp{key[1]} b{key[2]}" + (f" {key[3]}" if key[3] else "")
        if base and key[1] > 1:
            out["ratio_to_tp1"][name] = {"per_step_ms": r["per_step_ms"], "tp1_per_step_ms": base["per_step_ms"],
                                         "ratio": r["per_step_ms"] / base["per_step_ms"]}
    for r in done:
        key = _key(r)
        name = f"{key[0]} tp{key[1]} b{key[2]}" + (f" {key[3]}" if key[3] else "")
        p = plain.get(key)
        if p is None or r is p:
            continue
        if r.get("kind") == "nocomm":
            out["allreduce_share"][name] = {
                "step_ms": p["per_step_ms"], "step_without_collectives_ms": r["per_step_ms"],
                "collectives_ms": p["per_step_ms"] - r["per_step_ms"],
                "share": (p["per_step_ms"] - r["per_step_ms"]) / p["per_step_ms"]}
        elif r.get("kind") == "spec":
            c = r["per_step_ms"] / p["per_step_ms"]
            out["spec_step"][name] = {
                "k": r["k"], "spec_step_ms": r["per_step_ms"], "plain_step_ms": p["per_step_ms"],
                "extra_ms": r["per_step_ms"] - p["per_step_ms"], "c": c,
                "projection": True,
                "projected_speedup": {f"alpha={a:g}": expected_tokens(a, r["k"]) / c for a in alphas},
                "formula": "(1 - a^(K+1)) / (1 - a) / c: every step a K-token verify of measured cost c x a plain "
                           "step; drafts accepted independently with probability a; host drafting time not counted"}
    return out
