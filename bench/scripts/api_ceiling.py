"""How many tokens/s the API side of ``tilespec serve`` can stream, and how that grows with API processes: the real
server (engine process, zmq, API processes, detokenizing, SSE) over an engine whose steps are fake -- every running
request gets one token per ``--step-ms`` -- so nothing but the API side and the load generator can be the limit.

For each ``--api-servers`` count and ``--clients`` level it runs the project's load generator (load_client.py) and
records tokens/s, TTFT / ITL percentiles, the API processes' CPU and the client's; then names the smallest count
within 5 % of the best at the largest level (``recommended_api_servers``), which a GPU run passes to the real
server. The fake engine emits the ids of a real text, decoded by ``--tokenizer`` (an HF folder; default: a tiny
stand-in), so detokenizing costs what it does in service.

    python bench/scripts/api_ceiling.py --tokenizer HF_FOLDER --api-servers 1,2,4 --clients 64,256 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(Path(__file__).parent)]

import load_client  # noqa: E402
from tilespec.env import host_record  # noqa: E402


class FakeSteps:
    """An engine hook: the engine's own scheduling is replaced by a fake one that gives every running request the
    next id of ``ids`` each ``step_s`` (busy-waited, as a GPU step holds its process), ending it at its max_tokens."""

    def __init__(self, step_s: float, ids: list):
        self.step_s, self.ids = step_s, ids

    def __call__(self, engine) -> None:
        from tilespec.engine.batch_request import BatchEvent
        reqs, counter = {}, iter(range(1 << 62))

        def submit(req):
            req.rid = next(counter)
            reqs[req.rid] = req
            return req.rid

        def step():
            t = time.perf_counter()
            out = []
            for rid, req in list(reqs.items()):
                tok = self.ids[len(req.tokens) % len(self.ids)]
                req.tokens.append(tok)
                done = len(req.tokens) >= req.max_tokens
                out.append(BatchEvent(rid, [tok], "length" if done else None))
                if done:
                    del reqs[rid]
            engine.counters["steps"] += 1
            engine.counters["generated_tokens"] += len(out)
            while time.perf_counter() - t < self.step_s:
                pass
            return out

        engine.submit, engine.step = submit, step
        engine.cancel = lambda rid: reqs.pop(rid, None)
        type(engine).has_work = property(lambda _: bool(reqs))


def standin_tokenizer():
    """A small byte-level BPE (GPT-2 / Qwen style) trained here, for machines without a model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["def quicksort(arr): return sorted(arr)", "café naïve 中文 🙂 text", "the quick brown fox"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", clean_up_tokenization_spaces=False)


def tiny_pair(tokenizer_path):
    """(target, draft, tokenizer): a 1-layer random Llama (its steps are never run) and the tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else standin_tokenizer()
    vocab = len(tok)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).eval(), None, tok


def run(args) -> dict:
    from tilespec.serve import serve_engine
    from tilespec.serve.core import EngineSpec
    from tilespec.serve.processes import main_server
    _, _, tok = tiny_pair(args.tokenizer)
    text = "def quicksort(arr):\n    return sorted(arr)  # café, naïve, 中文 🙂\n" * 4
    ids = tok(text, add_special_tokens=False).input_ids
    prompts = load_client_prompts()
    result = {"levels": {}, "settings": vars(args)}
    for n in [int(x) for x in args.api_servers.split(",")]:
        spec = EngineSpec(load=partial(tiny_pair, args.tokenizer), warmup=False,
                          hook=FakeSteps(args.step_ms / 1000, ids),
                          options=dict(max_batch=max(int(c) for c in args.clients.split(",")), gamma=0, max_len=4096,
                                       prefix_caching=False))
        app = serve_engine(spec, model_name="bench", api_servers=n, shutdown_timeout=5, max_queue=4096)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server, sock = main_server(app, "127.0.0.1", port, log_level="warning")
        thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 120)
        api = [p.pid for p in app.state.engine.api_processes]
        for clients in [int(c) for c in args.clients.split(",")]:
            cpu0 = time.process_time() + sum(cpu_of(p) for p in api)
            level = load_client.run_level(url, "bench", prompts, clients, max(args.min_requests, 4 * clients), 0.0,
                                          args.max_tokens, 0.0, until=args.level_seconds, ignore_eos=True,
                                          keep_records=False)
            level["api_cpu_s"] = time.process_time() + sum(cpu_of(p) for p in api) - cpu0
            level = {k: v for k, v in level.items() if k != "records"}
            result["levels"][f"{n}x{clients}"] = level
            print(f"api servers {n}, clients {clients}: {level['throughput_tok_s']:.0f} tok/s, ttft p50 "
                  f"{level['ttft_p50_s']}, itl p50 {level['itl_p50_s']}, errors {level['errors']}", flush=True)
        server.should_exit = True
        thread.join(30)
        app.state.engine.kill()
    top = max(int(c) for c in args.clients.split(","))
    rates = {int(k.split("x")[0]): v["throughput_tok_s"] for k, v in result["levels"].items()
             if k.endswith(f"x{top}")}
    best = max(rates.values())
    result["recommended_api_servers"] = min(n for n, r in rates.items() if r >= 0.95 * best)
    result["offered_tok_s_at_top"] = top / (args.step_ms / 1000)
    return result


def cpu_of(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


def wait_healthy(url: str, timeout: float) -> None:
    import urllib.request
    end = time.time() + timeout
    while time.time() < end:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


def load_client_prompts() -> list:
    return [f"Rewrite this function with a docstring (variant {i}):\ndef f(x):\n    return x * {i}\n" for i in range(64)]


def _gpu_name() -> str:
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU-only"
    except Exception:          # the API side needs no torch; a machine without it is named by its CPUs alone
        return "a"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=None, help="an HF folder whose tokenizer decodes the fake tokens")
    p.add_argument("--api-servers", default="1,2,4")
    p.add_argument("--clients", default="64,256")
    p.add_argument("--step-ms", type=float, default=3.0, help="the fake engine's step time")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=64)
    p.add_argument("--level-seconds", type=float, default=8.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    result = run(args)
    result["device"] = f"{_gpu_name()} machine ({os.cpu_count()} CPU cores; the fake engine uses no GPU)"
    result["environment"] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                             "machine": platform.machine(), "commit": os.environ.get("TILESPEC_COMMIT", "unknown"),
                             "date": time.strftime("%Y-%m-%d"), **host_record()}
    print(f"recommended_api_servers {result['recommended_api_servers']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
