"""Load benchmark of OpenAI-compatible servers: ``tilespec serve`` with and without speculation against vLLM and
``transformers serve --continuous-batching``, on the same machine in one run. Writes one JSON.

Each system is a server this script starts (and stops) in turn:
  * ``tilespec:DRAFT``  -> ``python -m tilespec serve --target TARGET --draft DRAFT`` (DRAFT: none, ngram, suffix,
    head / head+ngram (the target's trained head in $TILESPEC_HOME/heads/), a head folder, a draft model name,
    MODEL+ngram; extra server flags with --tilespec-args);
  * ``vllm``, ``vllm:ngram`` -> ``python -m vllm.entrypoints.cli.main serve HF_MODEL`` (bf16, --max-num-seqs
    --max-batch; ngram: speculative config ngram, 4 tokens, prompt lookup 4) from --vllm-site (default /tmp/vsite,
    where shared/tools/vllm-offline's INSTALL.sh puts it), PYTHONPATH set to that folder alone;
  * ``hf``              -> ``transformers serve --continuous-batching HF_MODEL`` (a local model folder or hub id);
  * ``stub``            -> ``stub_server.py`` beside this file (tokens at a fixed rate per stream: no model);
  * ``url:NAME=URL``    -> an already running server at URL (nothing started), model id from its /v1/models.
A system may carry its own settings after ``|``: server flags and ``NAME=VALUE`` environment variables, e.g.
``"tilespec:ngram|--gamma 2|TILESPEC_NATIVE_KERNELS=attn"`` (results are keyed by the whole string).

The client (``load_client.py`` beside this file) is --client-procs processes (default min(8, cores / 2)), each one
asyncio loop speaking HTTP/1.1 and SSE itself; the clients of a level are split over them and their records merged.
For every level of concurrent clients (--clients 1,4,16,64) it sends N = max(--min-requests, requests-per-client x
clients) streamed chat requests (``stream_options.include_usage``; ``ignore_eos`` with --ignore-eos), at most
``clients`` in flight: arrivals form a Poisson process of rate --rate requests/s (0: closed loop, each client sends
its next request when its previous one ends); --level-seconds S sends no request later than S seconds into the level
(``requests`` / ``planned_requests`` / ``stopped_by_time`` say what ran). Per request it records time to first token
(TTFT), inter-token latency (ITL = (end - first token) / (tokens - 1)), the gaps between streamed chunks,
completion tokens (usage), finish reason, a hash of the text and, for a failed request, the error with the server's
reason (HTTP status and body, an error event, or the exception and where the connection broke). Per level:
throughput (completion tokens / wall time), steady tokens/s (while every client streams), p50 / p99 of TTFT, ITL and
chunk gaps, errors by kind, the client's CPU use, the server's CPU seconds (its process group) and /metrics counters
over the level (tilespec: steps, drafted / accepted tokens; vLLM: its counters, whatever parses), and - at
temperature 0 - how many texts differ from the same system's one-client texts ("changed": batching must not corrupt
responses; bf16 forwards of other batch shapes may legitimately flip a near-tie). Ratios against tilespec:none, vllm
and hf at the same level close the file.
--stub-check first runs the same load against the stub server (--stub-procs processes, one token every
--stub-token-ms ms per stream) and writes ``load_generator_check``: achieved vs offered tokens/s per level, the
client's and the stub's CPU use, and the generator's ceiling against the highest rate the systems reached.
--soak-seconds S then keeps the largest level's load on the last system for S seconds and counts failed / truncated
responses. ``--target`` names the model for tilespec (registry name); --hf-model the same weights for vLLM and
transformers (a converted HF folder).
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import ctypes.util
import importlib.util
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def _sibling(name: str):
    """A script beside this one as a module (not through sys.path: bench/scripts' names would shadow others)."""
    key = f"_serve_load_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


load_client = _sibling("load_client")
percentile, summarize = load_client.percentile, load_client.summarize     # this module's API too

VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
VLLM_NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'


def load_prompts(task: str, limit: int, seed: int) -> list[str]:
    if task == "synthetic":
        rng = random.Random(seed)
        words = "alpha beta gamma delta code list sort value return tree node graph path".split()
        return [" ".join(rng.choice(words) for _ in range(rng.randrange(4, 24))) for _ in range(limit)]
    sys.path.insert(0, str(ROOT / "src"))
    from tilespec.datasets import load_task
    return [r["prompt"] for r in load_task(task, limit=limit, seed=seed)]


def run_level(url: str, model: str, prompts: list, clients: int, n: int, rate: float, max_tokens: int,
              temperature: float, seed: int = 0, timeout: float = 600.0, until: float = 0.0, **kw) -> dict:
    """Send ``n`` streamed requests (prompt i % len(prompts), seed seed + i) with at most ``clients`` in flight and
    Poisson arrivals of ``rate`` per second (0: closed loop) -> the level's summary and per-request records.
    ``until`` > 0: requests not started ``until`` seconds after the first are not sent (a soak of a fixed duration,
    a level's time cap: pass a large ``n``). ``kw``: load_client.run_level's (procs, ignore_eos, keep_records)."""
    return load_client.run_level(url, model, prompts, clients, n, rate, max_tokens, temperature, seed=seed,
                                 timeout=timeout, until=until, **kw)


def server_metrics(url: str) -> dict:
    """The server's /metrics (Prometheus text) as {name{labels}: value}, histogram buckets and ``_created``
    timestamps left out; {} where there is none (e.g. transformers serve)."""
    try:
        resp = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out = {}
    for line in resp.text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if not base or base.endswith(("_bucket", "_created")):
            continue
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def _cumulative(name: str) -> bool:
    return name.split("{", 1)[0].endswith(("_total", "_sum", "_count"))


def metrics_delta(before: dict, after: dict) -> dict:
    """Counters (``_total``, ``_sum``, ``_count``, labels or not): this level's increase; gauges: their value now."""
    return {k: v - before.get(k, 0.0) if _cumulative(k) else v for k, v in after.items()}


def _sum_of(metrics: dict, *bases: str):
    found = [v for k, v in metrics.items() if k.split("{", 1)[0] in bases]
    return sum(found) if found else None


def server_summary(delta: dict, client_tokens: int) -> dict:
    """The few numbers that compare across servers, from a level's /metrics increase: generated tokens (and their
    ratio to the completion tokens the client counted), drafted and accepted tokens, acceptance."""
    gen = _sum_of(delta, "tilespec_generated_tokens_total", "vllm:generation_tokens_total")
    drafted = _sum_of(delta, "tilespec_drafted_total", "vllm:spec_decode_num_draft_tokens_total")
    accepted = _sum_of(delta, "tilespec_accepted_total", "vllm:spec_decode_num_accepted_tokens_total")
    return {"generated_tokens": gen, "generated_vs_client": gen / client_tokens if gen and client_tokens else None,
            "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted and accepted is not None else None}


def group_cpu_seconds(pgid) -> float | None:
    """CPU seconds (user + system) of the live processes of process group ``pgid`` (Linux /proc; None elsewhere)."""
    if pgid is None or not Path("/proc/self/stat").exists():
        return None
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:              # fields after the name: state ppid pgrp ... utime(12) stime(13)
            total += int(fields[11]) + int(fields[12])
    return total / tick


def group_alive(pgid) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count)."""
    if not Path("/proc/self/stat").exists():
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


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


def server_command(system: str, args, port: int) -> tuple:
    """(command, model id, extra environment) of a system this script starts."""
    system, flags, extra_env = split_system(system)
    env = {"PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if system.startswith("tilespec:"):
        draft = system.split(":", 1)[1]
        cmd = [sys.executable, "-m", "tilespec", "serve", "--target", args.target, "--draft", draft, "--port",
               str(port), "--max-batch", str(args.max_batch), "--served-model-name", "bench",
               "--log-level", "warning", *args.tilespec_args.split(), *flags]
        model = "bench"
    elif system in ("vllm", "vllm:ngram"):
        if not args.hf_model or not Path(args.hf_model).is_dir():
            raise RuntimeError(f"system {system} needs --hf-model, a local HF folder of the weights "
                               f"(got {args.hf_model!r})")
        if not (Path(args.vllm_site) / "vllm").is_dir():
            raise RuntimeError(f"vLLM is not installed in {args.vllm_site} (shared/tools/vllm-offline: INSTALL.sh)")
        # request logging is off by default; vLLM >= 0.12 no longer knows --disable-log-requests
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(args.hf_model), "--dtype", "bfloat16",
               "--port", str(port), "--host", "127.0.0.1", "--max-num-seqs", str(args.max_batch),
               "--served-model-name", "bench", *args.vllm_args.split(), *flags]
        if system == "vllm:ngram":
            cmd += ["--speculative-config", VLLM_NGRAM]
        env = dict(VLLM_ENV, PYTHONPATH=str(args.vllm_site))      # vLLM's own pins, not the bench's wheels
        model = "bench"
    elif system == "hf":
        if not args.hf_model:
            raise SystemExit("system hf needs --hf-model (a local model folder or hub id of the same weights)")
        cmd = ["transformers", "serve", "--continuous-batching", "--port", str(port), "--host", "127.0.0.1",
               *args.hf_args.split(), *flags, args.hf_model]
        model = args.hf_model
    elif system == "stub":
        cmd = [sys.executable, str(HERE / "stub_server.py"), "--port", str(port), "--procs", str(args.stub_procs),
               "--token-ms", str(args.stub_token_ms), "--model", "bench", *flags]
        model = "bench"
    else:
        raise SystemExit(f"unknown system {system!r}: tilespec:DRAFT, vllm, vllm:ngram, hf, stub or url:NAME=URL")
    return cmd, model, {**env, **extra_env}


def _log_tail(log: Path, lines: int = 15) -> str:
    try:
        return " | ".join(x for x in log.read_text(errors="replace").splitlines()[-lines:] if x.strip())[-1500:]
    except OSError:
        return ""


def start_server(system: str, args, port: int, log: Path):
    """(process or None, base url, model id) for a system name."""
    if split_system(system)[0].startswith("url:"):
        name, _, url = split_system(system)[0][4:].partition("=")
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        return None, url, model
    cmd, model, extra_env = server_command(system, args, port)
    proc = spawn_tied(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ, **extra_env))
    url = f"http://127.0.0.1:{port}"
    start = time.time()
    end = start + args.start_timeout
    while time.time() < end:
        if proc.poll() is not None:
            stop_server(proc)
            raise RuntimeError(f"{system} exited with {proc.returncode}; see {log}: {_log_tail(log)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                print(f"{system}: healthy after {time.time() - start:.0f} s", flush=True)
                return proc, url, model
        except httpx.HTTPError:
            pass
        time.sleep(1.0 if time.time() - start > 5 else 0.1)
    stop_server(proc)
    raise RuntimeError(f"{system} did not become healthy in {args.start_timeout} s; see {log}: {_log_tail(log)}")


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


def stop_server(proc, grace: float = 60.0) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace`` s, and wait (30 s at most) until no process of
    the group is left (vLLM's engine core, a child, holds the GPU's memory until it is gone); it is then no longer
    killed at exit."""
    if proc is None:
        return
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        end = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < end:
            time.sleep(0.2)
        if group_alive(proc.pid) or proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            end = time.monotonic() + 30
            while group_alive(proc.pid) and time.monotonic() < end:
                time.sleep(0.2)
    except ProcessLookupError:
        pass
    finally:
        if proc in _SERVERS:
            _SERVERS.remove(proc)


def ratios(levels: dict) -> dict:
    """Per baseline (tilespec:none, vllm, hf) and level: each system's throughput and ITL ratio (system / baseline)."""
    out = {}
    named = {split_system(system)[0]: system for system in levels}      # "tilespec:none|--api-servers 1" by name
    for base in ("tilespec:none", "vllm", "hf"):
        if base not in named:
            continue
        for system, rows in levels.items():
            for c, row in rows.items():
                ref = levels[named[base]].get(c)
                if system == named[base] or ref is None:
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


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stub_check(args, prompts: list, clients: list, log: Path) -> dict:
    """The load generator's own ceiling: the same load against the stub server, achieved vs offered tokens/s."""
    port = free_port()
    proc, url, model = start_server("stub", args, port, log)
    per_stream = 1000.0 / args.stub_token_ms
    out = {"stub": {"procs": args.stub_procs, "token_ms": args.stub_token_ms, "per_stream_tok_s": per_stream,
                    "max_tokens": args.max_tokens, "level_seconds": args.stub_seconds},
           "client_procs": args.client_procs, "cpu_count": os.cpu_count(), "levels": {}}
    try:
        for c in clients:
            per_client = int(args.stub_seconds * per_stream / args.max_tokens) + 2
            cpu0 = group_cpu_seconds(proc.pid)
            row = run_level(url, model, prompts, c, 2 * c * per_client, 0.0, args.max_tokens, 0.0,
                            until=args.stub_seconds, procs=args.client_procs, ignore_eos=args.ignore_eos,
                            keep_records=False)
            cpu1 = group_cpu_seconds(proc.pid)
            offered = c * per_stream
            stub_cpu = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
            stub_util = stub_cpu / (row["wall_s"] * args.stub_procs) if stub_cpu is not None and row["wall_s"] else None
            achieved = (row["throughput_tok_s"] or 0.0) / offered
            cutil = row["client"]["cpu_util_max"] or 0.0
            limited = ("offered rate reached" if achieved >= 0.85 else "client CPU" if cutil >= 0.85 else
                       "stub CPU" if (stub_util or 0) >= 0.85 else "neither process saturated (machine or scheduling)")
            out["levels"][str(c)] = {**row, "offered_tok_s": offered, "achieved_vs_offered": achieved,
                                     "stub_cpu_s": stub_cpu, "stub_cpu_util": stub_util, "limited_by": limited}
            print(f"stub check clients={c}: {row['throughput_tok_s'] or 0:.0f} tok/s of {offered:.0f} offered "
                  f"({achieved:.0%}), client cpu max {cutil:.0%} ({row['client']['us_per_token'] or 0:.1f} us a "
                  f"token, {row['chunks_per_read'] or 0:.1f} chunks a read), stub cpu {stub_util or 0:.0%}, "
                  f"errors {row['errors']}: {limited}", flush=True)
    finally:
        stop_server(proc, grace=5)
    out["ceiling_tok_s"] = max((r["throughput_tok_s"] or 0.0 for r in out["levels"].values()), default=None)
    return out


def check_headroom(result: dict) -> None:
    """``load_generator_check``: the generator's ceiling against the highest throughput a system reached, overall
    and per level (the stub's at c clients / the best system's at c)."""
    check = result.get("load_generator_check")
    if not check or "levels" not in check:
        return
    best = {}
    for system, rows in result["levels"].items():
        if split_system(system)[0] == "stub":
            continue
        for c, row in rows.items():
            if row.get("throughput_tok_s"):
                best[c] = max(best.get(c, 0.0), row["throughput_tok_s"])
    highest = max(best.values(), default=None)
    ceiling = check.get("ceiling_tok_s")
    check["highest_measured_tok_s"] = highest
    check["headroom"] = ceiling / highest if ceiling and highest else None
    check["at_least_2x"] = check["headroom"] >= 2 if check["headroom"] else None
    # per level: where the stub ran at its offered rate, its tokens/s is a floor of the client's ceiling, not it
    check["headroom_by_clients"] = {
        c: {"stub_tok_s": check["levels"][c]["throughput_tok_s"], "best_system_tok_s": th,
            "ratio": check["levels"][c]["throughput_tok_s"] / th,
            "stub_at_offered_rate": check["levels"][c]["limited_by"] == "offered rate reached"}
        for c, th in best.items() if c in check["levels"] and check["levels"][c].get("throughput_tok_s")}


RESUME_IGNORES = ("systems", "clients", "soak_seconds", "soak_system", "out", "log_dir", "port", "start_timeout",
                  "stub_check", "stub_clients", "stub_seconds", "stub_procs", "stub_token_ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--hf-model", default=None,
                   help="the target's weights for vllm and transformers serve (a converted HF folder / hub id)")
    p.add_argument("--systems", default="tilespec:none,tilespec:ngram,hf")
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--min-requests", type=int, default=16, help="requests of a level at least (default 16)")
    p.add_argument("--level-seconds", type=float, default=0.0,
                   help="no request of a level starts later than this many seconds into it (0: no cap)")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrival rate, requests/s (0: closed loop)")
    p.add_argument("--task", default="code-edit", help="code-edit, cnndm, xsum or synthetic")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send vLLM's ignore_eos: every request makes max_tokens tokens (not sent to hf)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--client-procs", type=int, default=load_client.default_procs(),
                   help="client processes (default min(8, cores / 2); 0: the client runs in this process)")
    p.add_argument("--client-cpus", default="off-engine",
                   help="where the client processes run: off-engine (off the CPUs tilespec serve's step loop "
                        "reserves, --engine-cpus auto: a client elsewhere, as in deployment) or anywhere")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=-1,
                   help="requests at the largest level before timing, so every batch shape is captured first "
                        "(default: the largest number of clients)")
    p.add_argument("--soak-seconds", type=float, default=0.0)
    p.add_argument("--soak-system", default=None,
                   help="the system kept at the largest level for --soak-seconds (default: the first speculative "
                        "tilespec system, else the first)")
    p.add_argument("--stub-check", action="store_true",
                   help="first measure the load generator against the stub server (load_generator_check)")
    p.add_argument("--stub-clients", default=None, help="client levels of the stub check (default: --clients)")
    p.add_argument("--stub-seconds", type=float, default=4.0, help="seconds of each stub-check level")
    p.add_argument("--stub-procs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 4)))
    p.add_argument("--stub-token-ms", type=float, default=1.0, help="the stub's ms between tokens of one stream")
    p.add_argument("--tilespec-args", default="", help="extra flags for tilespec serve, e.g. '--no-draft-pricing'")
    p.add_argument("--vllm-args", default="", help="extra flags for vllm serve, e.g. '--gpu-memory-utilization 0.8'")
    p.add_argument("--vllm-site", default="/tmp/vsite", help="the folder vLLM is installed in (its PYTHONPATH)")
    p.add_argument("--hf-args", default="", help="extra flags for transformers serve, e.g. '--cb-use-cuda-graph'")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--log-dir", type=Path, default=Path("serve-load-logs"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from tilespec.env import run_record
    clients = [int(c) for c in args.clients.split(",")]
    from tilespec.serve.cpus import engine_cpus
    avoid = sorted(engine_cpus("auto")) if args.client_cpus == "off-engine" else []
    prompts = load_prompts(args.task, args.num_prompts, 0)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["client_cpus_avoided"] = avoid
    result = {"environment": {**run_record(None, "fastapi", "uvicorn", "openai", "orjson", "uvloop"),
                              "cpu_count": os.cpu_count()},
              "settings": settings, "levels": {}, "soak": None}
    if args.out.is_file():              # resume: keep the finished (system, level) rows of a run with these settings
        old = json.loads(args.out.read_text())
        same = {k: v for k, v in old.get("settings", {}).items() if k not in RESUME_IGNORES}
        if same == {k: v for k, v in settings.items() if k not in RESUME_IGNORES}:
            result["levels"] = old.get("levels", {})
            if old.get("load_generator_check"):
                result["load_generator_check"] = old["load_generator_check"]
            print(f"resuming {args.out}: {sum(len(v) for v in result['levels'].values())} levels done", flush=True)
    warmup = args.warmup if args.warmup >= 0 else max(clients)

    def save():
        result["ratios"] = ratios({s: {str(c): {k: v for k, v in row.items() if k != "records"}
                                       for c, row in rows.items()} for s, rows in result["levels"].items()})
        check_headroom(result)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(result, separators=(",", ":")))   # records hold every token gap: compact
        os.replace(tmp, args.out)

    if args.stub_check and "load_generator_check" not in result:
        stub_clients = [int(c) for c in (args.stub_clients or args.clients).split(",")]
        try:
            result["load_generator_check"] = stub_check(args, prompts, stub_clients, args.log_dir / "stub-check.log")
        except (RuntimeError, OSError) as err:
            result["load_generator_check"] = {"error": str(err)}
            print(f"stub check: {err}", flush=True)
        save()

    systems = [s for s in args.systems.split(",") if s]
    soak_at = soak_index(systems, args.soak_system) if args.soak_seconds > 0 and systems else -1
    for i, system in enumerate(systems):
        done = result["levels"].get(system, {})
        if all(str(c) in done for c in clients) and i != soak_at:
            continue
        log = args.log_dir / f"{i}-{''.join(c if c.isalnum() else '-' for c in system)[:80]}.log"
        try:
            t_start = time.time()
            proc, url, model = start_server(system, args, args.port + i, log)
            result.setdefault("start_s", {})[system] = round(time.time() - t_start, 1)
        except (RuntimeError, OSError, httpx.HTTPError) as err:   # a system that cannot start is recorded
            result.setdefault("failed_systems", {})[system] = str(err)
            print(f"{system}: {err}", flush=True)
            save()
            continue
        eos = args.ignore_eos and split_system(system)[0] != "hf"
        common = dict(procs=args.client_procs, ignore_eos=eos, timeout=args.request_timeout, avoid_cpus=avoid)
        pgid = proc.pid if proc is not None else None
        try:
            if warmup:
                run_level(url, model, prompts, max(clients), warmup, 0.0, args.max_tokens, args.temperature,
                          seed=10**6, keep_records=False, **common)
            rows = result["levels"].setdefault(system, {})
            for c in clients:
                if str(c) in rows:
                    continue
                n = max(args.min_requests, args.requests_per_client * c)
                before, cpu0 = server_metrics(url), group_cpu_seconds(pgid)
                row = run_level(url, model, prompts, c, n, args.rate, args.max_tokens, args.temperature,
                                until=args.level_seconds, **common)
                after, cpu1 = server_metrics(url), group_cpu_seconds(pgid)
                row["server"] = metrics_delta(before, after)
                row["server_summary"] = server_summary(row["server"], row["completion_tokens"])
                row["server_cpu_s"] = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
                if args.temperature == 0 and str(min(clients)) in rows:
                    solo = {r["prompt"]: r.get("text_hash") for r in rows[str(min(clients))]["records"]}
                    row["changed"] = sum(r.get("text_hash") != solo.get(r["prompt"], r.get("text_hash"))
                                         for r in row["records"] if r["ok"])
                rows[str(c)] = row
                print(f"{system} clients={c}: {row['requests']}/{n} requests, {row['throughput_tok_s']} tok/s "
                      f"(steady {row['steady_tok_s']}), ttft p50 {row['ttft_p50_s']}, itl p50 {row['itl_p50_s']}, "
                      f"errors {row['errors']} {row['error_samples'][:1]}, client cpu max "
                      f"{row['client']['cpu_util_max']}, server cpu {row['server_cpu_s']} s", flush=True)
                save()
            if i == soak_at:
                c = max(clients)
                # an upper bound the soak's clock, not its count, ends: the level's rate can be far below the
                # soak's (a short level dominated by its first, compiling requests)
                n = max(256 * c, int(8 * args.soak_seconds * (rows[str(c)]["requests_per_s"] or 1)))
                soak = run_level(url, model, prompts, c, n, 0.0, args.max_tokens, args.temperature,
                                 seed=10**7, until=args.soak_seconds, **common)
                records = soak.pop("records")
                if args.temperature == 0:    # greedy texts against the one-client level's (where it has the prompt)
                    solo = {r["prompt"]: r.get("text_hash") for r in rows[str(min(clients))]["records"] if r["ok"]}
                    seen = [r for r in records if r["ok"] and r["prompt"] in solo]
                    soak["compared_with_solo"] = len(seen)
                    soak["changed_vs_solo"] = sum(r.get("text_hash") != solo[r["prompt"]] for r in seen)
                soak["failed_samples"] = [r["error"] for r in records if "error" in r][:20]
                result["soak"] = {"system": system, **soak}
                save()
        finally:
            stop_server(proc)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
