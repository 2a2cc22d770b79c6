"""Load benchmark of OpenAI-compatible servers: ``tilespec serve`` with and without speculation against
``transformers serve --continuous-batching``, on the same machine in one run. Writes one JSON.

Each system is a server this script starts (and stops) in turn:
  * ``tilespec:DRAFT``  -> ``python -m tilespec serve --target TARGET --draft DRAFT`` (DRAFT: none, ngram, suffix,
    head / head+ngram (the target's trained head in $TILESPEC_HOME/heads/), a head folder, a draft model name,
    MODEL+ngram; extra server flags with --tilespec-args);
  * ``hf``              -> ``transformers serve --continuous-batching HF_MODEL`` (a local model folder or hub id);
  * ``url:NAME=URL``    -> an already running server at URL (nothing started), model id from its /v1/models.
A system may carry its own settings after ``|``: server flags and ``NAME=VALUE`` environment variables, e.g.
``"tilespec:ngram|--spec-max-batch 16|TILESPEC_NATIVE_KERNELS=attn"`` (results are keyed by the whole string).
For every level of concurrent clients (--clients 1,4,16,64) it sends N = max(16, requests-per-client x clients)
streamed chat requests with the OpenAI client: arrivals form a Poisson process of rate --rate requests/s (0: closed
loop, each client sends its next request when its previous one ends), at most ``clients`` in flight. Per request it
records time to first token (TTFT), inter-token latency (ITL = (end - first token) / (tokens - 1)), the gaps between
streamed chunks, completion tokens (usage), finish reason and a hash of the text. Per level: throughput (completion
tokens / wall time), p50 / p99 of TTFT, ITL and chunk gaps, errors, the server's /metrics counters over the level
(tilespec: steps, drafted / accepted tokens, which row counts draft), and - at temperature 0 - how many texts differ
from the same system's one-client texts ("changed": batching must not corrupt responses; bf16 forwards of other
batch shapes may legitimately flip a near-tie). Ratios against tilespec:none and hf at the same level close the file.
--soak-seconds S then keeps the largest level's load on the last system for S seconds and counts failed / truncated
responses. ``--target`` names the model for tilespec (registry name); --hf-model the same weights for transformers.
"""
from __future__ import annotations

import argparse
import asyncio
import atexit
import ctypes
import ctypes.util
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def percentile(values, q):
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def load_prompts(task: str, limit: int, seed: int) -> list[str]:
    if task == "synthetic":
        rng = random.Random(seed)
        words = "alpha beta gamma delta code list sort value return tree node graph path".split()
        return [" ".join(rng.choice(words) for _ in range(rng.randrange(4, 24))) for _ in range(limit)]
    sys.path.insert(0, str(ROOT / "src"))
    from tilespec.datasets import load_task
    return [r["prompt"] for r in load_task(task, limit=limit, seed=seed)]


async def one_request(client, model, prompt, max_tokens, temperature, seed, t0) -> dict:
    rec = {"sent": time.perf_counter() - t0, "ok": False}
    gaps, last, text, tokens, reason = [], None, [], None, None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=temperature, seed=seed, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices or ():
                piece = choice.delta.content or ""
                if piece:
                    if last is None:
                        rec["first"] = now
                    else:
                        gaps.append(now - last)
                    last = now
                    text.append(piece)
                reason = choice.finish_reason or reason
        rec.update(ok=reason in ("stop", "length"), end=time.perf_counter() - t0, tokens=tokens, finish=reason,
                   gaps=gaps, text_hash=hashlib.sha1("".join(text).encode()).hexdigest()[:16], chars=len("".join(text)))
    except Exception as err:          # counted, never fatal: the benchmark measures robustness too
        rec.update(error=f"{type(err).__name__}: {err}"[:300], end=time.perf_counter() - t0)
    return rec


async def run_level(url: str, model: str, prompts: list, clients: int, n: int, rate: float, max_tokens: int,
                    temperature: float, seed: int = 0, timeout: float = 600.0, until: float = 0.0) -> dict:
    """Send ``n`` streamed requests (prompt i % len(prompts), seed seed + i) with at most ``clients`` in flight and
    Poisson arrivals of ``rate`` per second (0: closed loop) -> the level's summary and per-request records.
    ``until`` > 0: requests not started ``until`` seconds after the first are not sent (a soak of a fixed duration:
    pass a large ``n``)."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 8),
                                                       timeout=timeout))
    gate = asyncio.Semaphore(clients)
    rng = random.Random(seed)
    t0 = time.perf_counter()

    async def job(i, delay):
        await asyncio.sleep(delay)
        async with gate:
            if until > 0 and time.perf_counter() - t0 > until:
                return None
            rec = await one_request(client, model, prompts[i % len(prompts)], max_tokens, temperature, seed + i, t0)
            rec["prompt"] = i % len(prompts)
            return rec

    delays, at = [], 0.0
    for _ in range(n):
        delays.append(at)
        at += rng.expovariate(rate) if rate > 0 else 0.0
    records = [r for r in await asyncio.gather(*(job(i, d) for i, d in enumerate(delays))) if r is not None]
    await client.close()
    return {"clients": clients, "requests": len(records), "rate": rate, **summarize(records), "records": records}


def server_metrics(url: str) -> dict:
    """The server's /metrics (Prometheus text) as {name: value}; {} where there is none (e.g. transformers serve)."""
    try:
        resp = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out = {}
    for line in resp.text.splitlines():
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def summarize(records: list) -> dict:
    ok = [r for r in records if r["ok"]]
    wall = max((r["end"] for r in records), default=0.0) - min((r["sent"] for r in records), default=0.0)
    tokens = sum(r["tokens"] or 0 for r in ok)
    ttft = [r["first"] - r["sent"] for r in ok if "first" in r]
    itl = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if "first" in r and (r["tokens"] or 0) > 1]
    gaps = [g for r in ok for g in r["gaps"]]
    return {"ok": len(ok), "errors": len(records) - len(ok), "wall_s": wall, "completion_tokens": tokens,
            "throughput_tok_s": tokens / wall if wall > 0 else None, "requests_per_s": len(ok) / wall if wall else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "chunk_gap_p50_s": percentile(gaps, 50), "chunk_gap_p99_s": percentile(gaps, 99),
            "finish": {k: sum(r.get("finish") == k for r in records) for k in ("stop", "length", "abort", None)},
            "error_samples": sorted({r["error"] for r in records if "error" in r})[:3]}


def split_system(system: str) -> tuple:
    """"NAME|flags|KEY=VALUE ..." -> (NAME, [flags], {KEY: VALUE})."""
    name, *extra = system.split("|")
    flags, env = [], {}
    for part in extra:
        for token in part.split():
            key, eq, value = token.partition("=")
            if eq and key.isupper() and not key.startswith("-"):
                env[key] = value
            else:
                flags.append(token)
    return name, flags, env


def start_server(system: str, args, port: int, log: Path):
    """(process or None, base url, model id) for a system name."""
    system, flags, extra_env = split_system(system)
    if system.startswith("url:"):
        name, _, url = system[4:].partition("=")
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        return None, url, model
    if system.startswith("tilespec:"):
        draft = system.split(":", 1)[1]
        cmd = [sys.executable, "-m", "tilespec", "serve", "--target", args.target, "--draft", draft, "--port",
               str(port), "--max-batch", str(args.max_batch), "--served-model-name", "bench",
               "--log-level", "warning", *args.tilespec_args.split(), *flags]
        model = "bench"
    elif system == "hf":
        if not args.hf_model:
            raise SystemExit("system hf needs --hf-model (a local model folder or hub id of the same weights)")
        cmd = ["transformers", "serve", "--continuous-batching", "--port", str(port), "--host", "127.0.0.1",
               *args.hf_args.split(), *flags, args.hf_model]
        model = args.hf_model
    else:
        raise SystemExit(f"unknown system {system!r}: tilespec:DRAFT, hf or url:NAME=URL")
    env = dict(os.environ, **extra_env, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = spawn_tied(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + args.start_timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, model
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"{system} did not become healthy in {args.start_timeout} s; see {log}")


_SERVERS: list = []                 # servers this process started and has not stopped: their groups die with it
_ARMED: list = []                   # [True] once the exit and signal handlers are installed


def _die_with(parent: int, libc) -> None:
    """In the child, before exec (Linux): the kernel sends it SIGKILL when ``parent`` exits, however it exits."""
    libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
    if os.getppid() != parent:              # the parent died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _kill_servers(*_signal) -> None:
    """SIGKILL every started server's process group (atexit, SIGTERM, SIGHUP); a signal then ends this process."""
    while _SERVERS:
        try:
            os.killpg(_SERVERS.pop().pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if _signal:
        raise SystemExit(128 + _signal[0])


def spawn_tied(cmd: list, **popen_kw) -> subprocess.Popen:
    """Start ``cmd`` in its own process group (so stopping it reaches what it starts) that dies with this process:
    killed at exit and on SIGTERM / SIGHUP (a ``timeout``), and by the kernel if this process is SIGKILLed (Linux's
    PR_SET_PDEATHSIG). A server killed only with its parent once held 68 GB of GPU memory after the run."""
    preexec = None
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        parent = os.getpid()
        preexec = lambda: _die_with(parent, libc)  # noqa: E731
    if not _ARMED and threading.current_thread() is threading.main_thread():
        _ARMED.append(True)
        atexit.register(_kill_servers)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _kill_servers)
    proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=preexec, **popen_kw)
    _SERVERS.append(proc)
    return proc


def stop_server(proc) -> None:
    """SIGTERM the server's process group, SIGKILL it after 60 s; it is then no longer killed at exit."""
    if proc is None:
        return
    if proc in _SERVERS:
        _SERVERS.remove(proc)
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def ratios(levels: dict) -> dict:
    """Per baseline (tilespec:none, hf) and level: each system's throughput ratio and ITL ratio (system / baseline)."""
    out = {}
    for base in ("tilespec:none", "hf"):
        if base not in levels:
            continue
        for system, rows in levels.items():
            for c, row in rows.items():
                ref = levels[base].get(c)
                if system == base or ref is None:
                    continue
                entry = out.setdefault(f"{system} vs {base}", {})
                th, rth = row.get("throughput_tok_s"), ref.get("throughput_tok_s")
                itl, ritl = row.get("itl_p50_s"), ref.get("itl_p50_s")
                entry[c] = {"throughput": th / rth if th and rth else None,
                            "itl_p50": itl / ritl if itl and ritl else None}
    return out


def soak_index(systems: list, wanted=None) -> int:
    """The index of the soaked system: ``wanted``, else the first tilespec system that drafts, else 0."""
    if wanted is not None:
        if wanted not in systems:
            raise SystemExit(f"--soak-system {wanted!r} is not one of --systems {systems}")
        return systems.index(wanted)
    return next((i for i, s in enumerate(systems) if s.startswith("tilespec:") and
                 not split_system(s)[0].endswith(":none")), 0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--hf-model", default=None, help="the target's weights for transformers serve (folder / hub id)")
    p.add_argument("--systems", default="tilespec:none,tilespec:ngram,hf")
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrival rate, requests/s (0: closed loop)")
    p.add_argument("--task", default="code-edit", help="code-edit, cnndm, xsum or synthetic")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--warmup", type=int, default=-1,
                   help="requests at the largest level before timing, so every batch shape is captured first "
                        "(default: the largest number of clients)")
    p.add_argument("--soak-seconds", type=float, default=0.0)
    p.add_argument("--soak-system", default=None,
                   help="the system kept at the largest level for --soak-seconds (default: the first speculative "
                        "tilespec system, else the first)")
    p.add_argument("--tilespec-args", default="", help="extra flags for tilespec serve, e.g. '--spec-max-batch 16'")
    p.add_argument("--hf-args", default="", help="extra flags for transformers serve, e.g. '--cb-use-cuda-graph'")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--log-dir", type=Path, default=Path("serve-load-logs"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from tilespec.env import run_record
    clients = [int(c) for c in args.clients.split(",")]
    prompts = load_prompts(args.task, args.num_prompts, 0)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"environment": run_record(None, "fastapi", "uvicorn", "openai"), "settings": settings, "levels": {},
              "soak": None}
    if args.out.is_file():              # resume: keep the finished (system, level) rows of a run with these settings
        old = json.loads(args.out.read_text())
        same = {k: v for k, v in old.get("settings", {}).items() if k not in ("systems", "clients", "soak_seconds")}
        if same == {k: v for k, v in settings.items() if k not in ("systems", "clients", "soak_seconds")}:
            result["levels"] = old.get("levels", {})
            print(f"resuming {args.out}: {sum(len(v) for v in result['levels'].values())} levels done", flush=True)
    warmup = args.warmup if args.warmup >= 0 else max(clients)

    def save():
        result["ratios"] = ratios({s: {str(c): {k: v for k, v in row.items() if k != "records"}
                                       for c, row in rows.items()} for s, rows in result["levels"].items()})
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    systems = args.systems.split(",")
    soak_at = soak_index(systems, args.soak_system) if args.soak_seconds > 0 else -1
    for i, system in enumerate(systems):
        done = result["levels"].get(system, {})
        if all(str(c) in done for c in clients) and i != soak_at:
            continue
        log = args.log_dir / f"{i}-{''.join(c if c.isalnum() else '-' for c in system)[:80]}.log"
        try:
            proc, url, model = start_server(system, args, args.port + i, log)
        except (RuntimeError, OSError) as err:      # a system that cannot start is recorded, the others still run
            result.setdefault("failed_systems", {})[system] = str(err)
            print(f"{system}: {err}", flush=True)
            save()
            continue
        try:
            if warmup:
                asyncio.run(run_level(url, model, prompts, max(clients), warmup, 0.0, args.max_tokens,
                                      args.temperature, seed=10**6))
            rows = result["levels"].setdefault(system, {})
            for c in clients:
                if str(c) in rows:
                    continue
                n = max(16, args.requests_per_client * c)
                before = server_metrics(url)
                row = asyncio.run(run_level(url, model, prompts, c, n, args.rate, args.max_tokens, args.temperature))
                after = server_metrics(url)      # counters: this level's increase; gauges (drafting per rows): now
                row["server"] = {k: v - before.get(k, 0.0) if k.endswith("_total") else v for k, v in after.items()}
                if args.temperature == 0 and str(min(clients)) in rows:
                    solo = {r["prompt"]: r.get("text_hash") for r in rows[str(min(clients))]["records"]}
                    row["changed"] = sum(r.get("text_hash") != solo.get(r["prompt"], r.get("text_hash"))
                                         for r in row["records"] if r["ok"])
                rows[str(c)] = row
                print(f"{system} clients={c}: {row['throughput_tok_s']} tok/s, ttft p50 {row['ttft_p50_s']}, "
                      f"itl p50 {row['itl_p50_s']}, errors {row['errors']}", flush=True)
                save()
            if i == soak_at:
                c = max(clients)
                n = max(c, int(4 * args.soak_seconds * (rows[str(c)]["requests_per_s"] or 1)))   # an upper bound
                soak = asyncio.run(run_level(url, model, prompts, c, n, 0.0, args.max_tokens, args.temperature,
                                             seed=10**7, until=args.soak_seconds))
                records = soak.pop("records")
                if args.temperature == 0:    # greedy texts against the one-client level's (where it has the prompt)
                    solo = {r["prompt"]: r.get("text_hash") for r in rows[str(min(clients))]["records"] if r["ok"]}
                    seen = [r for r in records if r["ok"] and r["prompt"] in solo]
                    soak["compared_with_solo"] = len(seen)
                    soak["changed_vs_solo"] = sum(r.get("text_hash") != solo[r["prompt"]] for r in seen)
                result["soak"] = {"system": system, **soak}
                save()
        finally:
            stop_server(proc)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
