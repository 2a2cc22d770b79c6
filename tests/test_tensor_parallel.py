"""Tensor parallelism on CPU: processes over gloo, a tiny Qwen2 (q/k/v biases), fp32; the sharded target's tokens
equal the unsharded native runtime's (TP=1) token for token, greedy and sampled (T=1, seeded), with a draft model
and with a context drafter, at world sizes 2 and 4; and the clear errors for bad launches and degrees."""
from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.native.tensor_parallel import check_divisible, check_launch
from tilespec.verify import SamplingParams

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 4, 9, 3, 4, 9, 3]]
# (draft, temperature): a draft model and the ngram context drafter, greedy and T=1
CASES = [("model", 0.0), ("model", 1.0), ("ngram", 0.0), ("ngram", 1.0), (None, 1.0)]


def tiny_qwen(seed: int, layers: int = 2, vocab: int = 130, kv: int = 4) -> Qwen2ForCausalLM:
    """8 query / ``kv`` K/V heads, MLP width 128 (divisible by 2, 4 and 8); vocab 130 (not: the LM head pads)."""
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=kv, max_position_embeddings=512,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)       # peaked laws: drafts get accepted and rejected
    return model


def decode_all(target, draft_model, compile) -> list:
    out = []
    for drafter, temperature in CASES:
        draft = draft_model if drafter == "model" else drafter
        dec = SpeculativeDecoder(target, draft, gamma=3, compile=compile, eos_token_id=[],
                                 sampling=SamplingParams(temperature=temperature))
        res = dec.generate(PROMPTS, max_new_tokens=10, seed=[11, 12])
        out.append(res.sequences)
    return out


def _worker(rank: int, world: int, port: int, folder: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tilespec.engine.native.tensor_parallel import check_consistent, init_tensor_parallel, shard
    tp = init_tensor_parallel(world)
    kv = 8 if world == 8 else 4              # K/V heads are split, not replicated: 8 ranks need 8
    target, draft = tiny_qwen(3, kv=kv), tiny_qwen(4, layers=1)
    reference = decode_all(copy.deepcopy(target), draft, "native") if rank == 0 else None
    shard(target, tp, check=True)
    assert target.model.layers[0].self_attn.q_proj.weight.is_meta        # the transformers path cannot run by accident
    sharded = decode_all(target, draft, False)
    for seqs in sharded:
        check_consistent(target, seqs)
    if rank == 0:
        Path(folder, "out.json").write_text(json.dumps({"reference": reference, "sharded": sharded}))
    if world == 2:
        _no_collectives(tp, folder)
        _generate_cli(rank, folder)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _no_collectives(tp, folder: str) -> None:
    """drop_collectives (the bench's all-reduce share): a target-only decode runs with no collective at all."""
    import torch.distributed._functional_collectives as funcol

    from tilespec.engine.native.tensor_parallel import shard
    from tilespec.engine.native import tp_collectives
    target = shard(tiny_qwen(3), tp)
    target._tilespec_native.drop_collectives()
    calls = {"gathers": 0, "sums": 0}
    gather, reduce = funcol.all_gather_tensor, tp_collectives.funcol.all_reduce

    def counted(name, fn):
        def call(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return call
    funcol.all_gather_tensor = counted("gathers", gather)
    tp_collectives.funcol.all_reduce = counted("sums", reduce)
    try:
        seq = SpeculativeDecoder(target, None, compile="native", eos_token_id=[]).generate(
            PROMPTS[:1], max_new_tokens=10, seed=1).sequences[0]
    finally:
        funcol.all_gather_tensor, tp_collectives.funcol.all_reduce = gather, reduce
    Path(folder, f"no-collectives-{tp.rank}.json").write_text(json.dumps({"length": len(seq), **calls}))


class _Chars:
    """A character tokenizer (ids 3..122) for the CLI."""

    chat_template, eos_token_id, pad_token_id = None, 2, 0

    def __call__(self, text, add_special_tokens=True):
        return type("Enc", (), {"input_ids": [1] + [3 + (ord(c) % 120) for c in text]})()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids if i > 2)


def _generate_cli(rank: int, folder: str) -> None:
    """``tilespec.generate(..., tp=2)``, ``tilespec bench e2e --tiny --tp 2`` (transformers' systems dropped) and
    ``tilespec generate --tp 2 --tp-check`` on this rank (model loading replaced: tiny model, sharded by load_pair's
    tensor-parallel path); rank 0 alone writes the JSON files."""
    import tilespec.api as api
    import tilespec.cli.generate as gen
    from tilespec import models
    from tilespec.cli import main

    models.load = lambda name, **kw: (tiny_qwen(3), _Chars())
    res = api.generate("abcabc", target="t", draft="ngram", tp=2, max_new_tokens=6, chat=False, compile="native")
    assert len(res.sequences[0]) == 6 and res.stats.runtime == "native"
    bench = Path(folder, f"bench-{rank}.json")
    assert main(["bench", "e2e", "--tiny", "--tp", "2", "--prompts", "1", "--batch", "1", "--temperatures", "0",
                 "--max-new-tokens", "4", "--systems", "hf,ar", "--warmup", "0", "--out", str(bench)]) == 0
    assert bench.exists() == (rank == 0)
    gen.load_pair = api.load_pair
    out = Path(folder, f"cli-{rank}.json")
    assert main(["generate", "--target", "t", "--draft", "ngram", "--prompt", "abcabcabc", "--tp", "2", "--tp-check",
                 "--max-new-tokens", "8", "--no-chat", "--json", str(out)]) == 0
    assert out.exists() == (rank == 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_sharded_tokens_equal_unsharded(world, tmp_path):
    # fork: the workers inherit the imported modules (a spawned worker re-imports transformers, ~10 s per process
    # on a loaded CI machine); each sets one thread before any torch work
    mp.start_processes(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="fork")
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["sharded"]) == len(CASES)
    for case, ref, got in zip(CASES, out["reference"], out["sharded"]):
        assert all(len(s) == 10 for s in got), case
        assert got == ref, case
    if world == 2:
        cli = json.loads((tmp_path / "cli-0.json").read_text())
        assert len(cli["tokens"][0]) == 8 and cli["stats"]["drafter"] == "ngram"
        bench = json.loads((tmp_path / "bench-0.json").read_text())
        assert [r["system"] for r in bench["results"]] == ["ar"] and "error" not in bench["results"][0]
        assert json.loads((tmp_path / "no-collectives-0.json").read_text()) == {"length": 10, "gathers": 0,
                                                                                "sums": 0}


def test_degree_must_divide_heads_and_mlp():
    cfg = tiny_qwen(0, layers=1).config
    check_divisible(cfg, 4)
    with pytest.raises(ValueError, match="does not divide .*key/value heads 4"):
        check_divisible(cfg, 8)
    with pytest.raises(ValueError, match="attention heads 8"):
        check_divisible(cfg, 3)


def test_launch_errors(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert check_launch(1) == (0, 1, 0)
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 2"):
        check_launch(2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="launcher started 4 processes"):
        check_launch(2)
    with pytest.raises(ValueError, match=">= 1"):
        check_launch(0)


def test_cli_without_launcher_says_how_to_launch(monkeypatch, capsys):
    from tilespec.cli import main
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert main(["generate", "--target", "t", "--prompt", "x", "--tp", "2"]) == 1
    assert "torchrun --nproc-per-node 2 -m tilespec" in capsys.readouterr().err


def test_allreduce_choice(monkeypatch):
    from tilespec.engine.native.tensor_parallel import resolve_allreduce
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("TILESPEC_TP_ALLREDUCE", raising=False)
    assert resolve_allreduce("auto", cpu) == "nccl"
    assert resolve_allreduce("auto", gpu) == "symm"        # measured faster on two H100s
    monkeypatch.setenv("TILESPEC_TP_ALLREDUCE", "nccl")
    assert resolve_allreduce("auto", gpu) == "nccl"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_allreduce("symm", cpu)
    with pytest.raises(ValueError, match="one of"):
        resolve_allreduce("mpi", cpu)
