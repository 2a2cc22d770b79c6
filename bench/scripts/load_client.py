"""The load generator of ``serve_load.py``: streamed OpenAI-style requests from several client processes, each an
asyncio loop speaking HTTP/1.1 itself (stdlib streams, keep-alive connections, chunked transfer decoding, SSE lines
parsed as they arrive), so that the client is not what limits the measured tokens/s.

``run_level(url, model, prompts, clients, n, ...)`` splits the ``clients`` of one level over ``procs`` worker
processes (``python load_client.py --worker JOB``; 0: in this process). Request i (prompt i % len(prompts), seed
seed + i) belongs to client slot i % clients, and each slot to one process. Closed loop (rate 0): each client sends
its next request when its previous one ends; ``rate`` > 0: Poisson arrivals (each process rate x its share of the
clients), at most its clients in flight. ``until`` > 0: requests not started ``until`` seconds after the level's
start are not sent. The workers start together (a ready / go handshake, one monotonic clock), so every record's
times (sent, first token, end) share one origin and the parent merges them into one level.

Per request: sent / first / end (s from the level's start), completion tokens (from the final usage chunk: the
request asks ``stream_options.include_usage``), finish reason, the gaps between content chunks, chunk count, a hash
of the text, and for a failed request ``error`` with the server's reason: ``HTTP 400: <body>``, an error event of
the stream, or the exception class, message and phase of a connection failure (``ConnectionResetError ... mid-stream
after 17 chunks``). ``summarize`` turns records into a level's summary. Standard library only (orjson / uvloop are
used where installed).
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

try:                                    # a faster JSON parser where installed; the stdlib one otherwise
    import orjson
    _loads = orjson.loads
except ImportError:                     # pragma: no cover - depends on the machine
    _loads = json.loads

clock = time.monotonic                  # CLOCK_MONOTONIC: one origin for every process of the machine


def default_procs() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def percentile(values, q):
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


class StreamError(Exception):
    """The response ended or broke before its end (the message says where)."""


# --------------------------------------------------------------------------------------------------- one request
class _Conn:
    __slots__ = ("reader", "writer", "used")

    def __init__(self, reader, writer):
        self.reader, self.writer, self.used = reader, writer, 0

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing())

    def close(self):
        try:
            self.writer.close()
        except Exception:              # already gone
            pass


class Client:
    """One process's HTTP/1.1 client: a pool of keep-alive connections to one server."""

    def __init__(self, url: str, model: str, max_tokens: int, temperature: float, t0: float, *,
                 endpoint: str = "chat", ignore_eos: bool = False, timeout: float = 600.0, extra: dict | None = None):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        base = parts.path.rstrip("/")
        self.path = base + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
        self.chat = endpoint == "chat"
        self.model, self.max_tokens, self.temperature, self.t0 = model, max_tokens, temperature, t0
        self.ignore_eos, self.timeout, self.extra = ignore_eos, timeout, dict(extra or {})
        self.idle: list = []
        self.stats = collections.Counter()

    def body(self, prompt: str, seed: int) -> bytes:
        req = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": seed,
               "stream": True, "stream_options": {"include_usage": True}}
        if self.chat:
            req["messages"] = [{"role": "user", "content": prompt}]
        else:
            req["prompt"] = prompt
        if self.ignore_eos:
            req["ignore_eos"] = True
        req.update(self.extra)
        return json.dumps(req).encode()

    async def _connect(self) -> _Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        sock = writer.get_extra_info("socket")
        try:                        # small requests go out at once (asyncio sets it too where it knows the protocol)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (AttributeError, OSError):
            pass
        self.stats["connections"] += 1
        return _Conn(reader, writer)

    async def close(self):
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    async def request(self, prompt: str, seed: int) -> dict:
        """One streamed request -> its record (never raises: a failure is the record's ``error``)."""
        payload = self.body(prompt, seed)
        head = (f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nUser-Agent: tilespec-load\r\n"
                f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload
        rec = {"sent": clock() - self.t0, "ok": False}
        state = {"phase": "connecting", "chunks": 0, "bytes": 0}
        try:
            await asyncio.wait_for(self._exchange(head, rec, state), self.timeout)
        except asyncio.TimeoutError:
            rec["error"] = f"TimeoutError: no end of response within {self.timeout:g} s ({self._where(state)})"
        except StreamError as err:
            rec["error"] = f"StreamError: {err}"
        except Exception as err:       # connection errors and the like: class, message and where it happened
            msg = str(err) or repr(err)
            rec["error"] = f"{type(err).__name__}: {msg} ({self._where(state)})"
        if "error" in rec:
            rec["error"] = rec["error"][:600]
            rec.setdefault("end", clock() - self.t0)
        return rec

    @staticmethod
    def _where(state) -> str:
        if state["phase"] == "streaming":
            return f"mid-stream after {state['chunks']} chunks, {state['bytes']} bytes"
        return f"while {state['phase']}"

    async def _exchange(self, head: bytes, rec: dict, state: dict):
        for attempt in (0, 1):
            conn = None
            while self.idle:
                conn = self.idle.pop()
                if conn.usable():
                    break
                conn.close()
                conn = None
            reused = conn is not None
            if conn is None:
                state["phase"] = "connecting"
                conn = await self._connect()
            try:
                state["phase"] = "sending the request"
                conn.writer.write(head)
                await conn.writer.drain()
                state["phase"] = "waiting for the response head"
                raw = await conn.reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError) as err:
                conn.close()
                partial = getattr(err, "partial", b"")
                # a kept-alive connection the server closed meanwhile: send once more on a new one
                if reused and attempt == 0 and not partial:
                    self.stats["stale_retries"] += 1
                    continue
                if isinstance(err, asyncio.IncompleteReadError):
                    raise StreamError(f"the server closed the connection before the end of the response head "
                                      f"({len(partial)} bytes of it: {partial[:200]!r})") from None
                raise
            break
        conn.used += 1
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            conn.close()
            raise StreamError(f"not an HTTP response: {lines[0][:200]!r}")
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            if key:
                headers[key.strip().lower()] = value.strip()
        rec["status"] = status
        keep = headers.get("connection", "").lower() != "close"
        if status != 200:
            state["phase"] = f"reading the HTTP {status} body"
            body = b"".join([piece async for piece in self._body(conn, headers, state, limit=1 << 16)])
            rec["error"] = f"HTTP {status}: {body.decode('utf-8', 'replace').strip()}"
            self._release(conn, keep and state.get("complete", False))
            return
        state["phase"] = "streaming"
        t0, gaps, text, pending = self.t0, [], [], b""
        last, tokens, reason, done, chat = None, None, None, False, self.chat
        reads = 0
        async for piece in self._body(conn, headers, state):
            now = clock() - t0
            reads += 1
            lines = (pending + piece).split(b"\n")
            pending = lines.pop()
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                obj = _loads(data)
                if "error" in obj and not obj.get("choices"):
                    rec["error"] = "stream error event: " + json.dumps(obj["error"])[:500]
                    continue
                usage = obj.get("usage")
                if usage:
                    tokens = usage.get("completion_tokens")
                for choice in obj.get("choices") or ():
                    piece_text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece_text:
                        if last is None:
                            rec["first"] = now
                        else:
                            gaps.append(round(now - last, 6))
                        last = now
                        text.append(piece_text)
                        state["chunks"] += 1
                    reason = choice.get("finish_reason") or reason
            if done:
                rec["end"] = now
        end = rec.setdefault("end", clock() - t0)
        joined = "".join(text)
        rec.update(tokens=tokens, finish=reason, gaps=gaps, chunks=state["chunks"], reads=reads, chars=len(joined),
                   text_hash=hashlib.sha1(joined.encode()).hexdigest()[:16], end=end)
        self._release(conn, keep and state.get("complete", False))
        if "error" in rec:
            return
        if not done and reason is None:
            raise StreamError(f"the response ended without a finish reason or [DONE] after {state['chunks']} "
                              f"chunks, {state['bytes']} bytes")
        rec["ok"] = reason in ("stop", "length")
        if not rec["ok"]:
            rec["error"] = f"finish reason {reason!r}"

    def _release(self, conn, keep: bool):
        if keep and conn.usable():
            self.idle.append(conn)
        else:
            conn.close()

    async def _body(self, conn, headers, state, limit: int = 0):
        """The response body's decoded pieces (chunked, Content-Length or up to the end of the connection);
        ``state['complete']`` is set once the body ended where its framing says."""
        reader = conn.reader
        if "chunked" in headers.get("transfer-encoding", "").lower():
            buf, pos = b"", 0
            while True:
                out = []
                while True:
                    nl = buf.find(b"\r\n", pos)
                    if nl < 0:
                        break
                    try:
                        size = int(buf[pos:nl].split(b";", 1)[0], 16)
                    except ValueError:
                        raise StreamError(f"bad chunk size line {bytes(buf[pos:nl])[:80]!r}")
                    if size == 0:
                        if buf.find(b"\r\n\r\n", nl) >= 0:      # the last chunk and the (empty) trailer
                            state["complete"] = True
                        break
                    end = nl + 2 + size
                    if len(buf) < end + 2:
                        break
                    out.append(buf[nl + 2:end])
                    pos = end + 2
                if out:
                    yield b"".join(out)
                if state.get("complete"):
                    return
                data = await reader.read(1 << 18)
                if not data:
                    raise StreamError(f"the server closed the connection inside the chunked body "
                                      f"({self._where(state)})")
                state["bytes"] += len(data)
                buf = buf[pos:] + data
                pos = 0
                if limit and len(buf) > limit:
                    yield buf[:limit]
                    return
        elif "content-length" in headers:
            left = int(headers["content-length"])
            while left > 0:
                data = await reader.read(min(left, 1 << 18))
                if not data:
                    raise StreamError(f"the server closed the connection with {left} body bytes missing")
                left -= len(data)
                state["bytes"] += len(data)
                yield data
            state["complete"] = True
        else:                                   # no framing: the body runs to the end of the connection
            while True:
                data = await reader.read(1 << 18)
                if not data:
                    return
                state["bytes"] += len(data)
                yield data


# ------------------------------------------------------------------------------------------------ one process
def split_clients(clients: int, procs: int) -> list:
    """The client slots of each process: ``clients`` split as evenly as possible over min(procs, clients)."""
    procs = max(1, min(procs, clients))
    base, extra = divmod(clients, procs)
    out, at = [], 0
    for p in range(procs):
        k = base + (p < extra)
        out.append(list(range(at, at + k)))
        at += k
    return out


async def run_share(job: dict, t0: float) -> dict:
    """One process's share of a level (``job``: see ``run_level``) -> {records, stats}."""
    client = Client(job["url"], job["model"], job["max_tokens"], job["temperature"], t0,
                    endpoint=job.get("endpoint", "chat"), ignore_eos=job.get("ignore_eos", False),
                    timeout=job.get("timeout", 600.0), extra=job.get("extra"))
    prompts, seed, until, slots = job["prompts"], job["seed"], job.get("until", 0.0), job["slots"]
    mine = set(slots)
    indices = [i for i in range(job["n"]) if i % job["clients"] in mine]
    records = []

    async def one(i):
        rec = await client.request(prompts[i % len(prompts)], seed + i)
        rec["prompt"] = i % len(prompts)
        records.append(rec)

    def late() -> bool:
        return until > 0 and clock() - t0 > until

    if job.get("rate", 0.0) > 0:       # Poisson arrivals of this process's share of the rate
        rate = job["rate"] * len(slots) / job["clients"]
        rng = random.Random(seed * 1000 + slots[0])
        gate = asyncio.Semaphore(len(slots))
        tasks, at = [], 0.0

        async def gated(i):
            async with gate:
                if not late():
                    await one(i)
        for i in indices:
            delay = at - (clock() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if late():
                break
            tasks.append(asyncio.ensure_future(gated(i)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    else:                               # closed loop: one coroutine per client slot, its requests in turn
        queues = collections.defaultdict(collections.deque)
        for i in indices:
            queues[i % job["clients"]].append(i)

        async def loop(q):
            while q and not late():
                await one(q.popleft())
        await asyncio.gather(*(loop(queues[s]) for s in slots))
    await client.close()
    return {"records": records, "stats": dict(client.stats)}


def _loop_factory():
    try:
        import uvloop
        return uvloop.new_event_loop, "uvloop"
    except ImportError:
        return None, "asyncio"


def _run(coro_fn, *args):
    factory, name = _loop_factory()
    if factory is not None and hasattr(asyncio, "Runner"):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro_fn(*args)), name
    return asyncio.run(coro_fn(*args)), "asyncio"


def _die_with_parent():
    if sys.platform.startswith("linux"):
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
        if os.getppid() == 1:
            os._exit(1)


def worker_main(job_path: str) -> int:
    """A worker process: read the job, say ready, wait for ``go T0``, run, write the result file."""
    _die_with_parent()
    job = json.loads(Path(job_path).read_text())
    avoid = set(job.get("avoid_cpus") or ())
    if avoid and hasattr(os, "sched_setaffinity"):      # off the server's reserved step-loop core
        rest = os.sched_getaffinity(0) - avoid
        if rest:
            os.sched_setaffinity(0, rest)
    print("ready", flush=True)
    line = sys.stdin.readline().split()
    if len(line) != 2 or line[0] != "go":
        return 2
    t0 = float(line[1])
    delay = t0 - clock()
    if delay > 0:
        time.sleep(delay)
    cpu0, w0 = time.process_time(), clock()
    out, loop = _run(run_share, job, t0)
    out["stats"].update(cpu_s=time.process_time() - cpu0, wall_s=clock() - w0, loop=loop, pid=os.getpid())
    tmp = job["out"] + ".tmp"
    Path(tmp).write_text(json.dumps(out))
    os.replace(tmp, job["out"])
    return 0


# ------------------------------------------------------------------------------------------------------ a level
def run_level(url: str, model: str, prompts: list, clients: int, n: int, rate: float, max_tokens: int,
              temperature: float, seed: int = 0, timeout: float = 600.0, until: float = 0.0, procs: int | None = None,
              ignore_eos: bool = False, endpoint: str = "chat", extra: dict | None = None,
              keep_records: bool = True, avoid_cpus=()) -> dict:
    """Send ``n`` streamed requests with at most ``clients`` in flight from ``procs`` processes (default
    ``default_procs()``; 0: this process) -> the level's summary, ``client`` (processes, their CPU seconds, loop,
    connections) and its per-request ``records`` (sorted by send time; dropped with ``keep_records=False``);
    ``avoid_cpus``: CPUs the worker processes stay off (the server's reserved step-loop core)."""
    procs = default_procs() if procs is None else procs
    shares = split_clients(clients, procs or 1)
    base = {"url": url, "model": model, "prompts": list(prompts), "clients": clients, "n": n, "rate": rate,
            "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "timeout": timeout, "until": until,
            "ignore_eos": ignore_eos, "endpoint": endpoint, "extra": extra, "avoid_cpus": list(avoid_cpus)}
    failures, outs = [], []
    if procs == 0:
        t0 = clock()
        cpu0 = time.process_time()
        out, loop = _run(run_share, dict(base, slots=shares[0]), t0)
        out["stats"].update(cpu_s=time.process_time() - cpu0, wall_s=clock() - t0, loop=loop, pid=os.getpid())
        outs.append(out)
    else:
        with tempfile.TemporaryDirectory(prefix="serve-load-") as tmp:
            workers, logs = [], []
            try:
                for p, slots in enumerate(shares):
                    job = Path(tmp) / f"job{p}.json"
                    job.write_text(json.dumps(dict(base, slots=slots, out=str(Path(tmp) / f"out{p}.json"))))
                    logs.append(open(Path(tmp) / f"err{p}.txt", "w"))
                    workers.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                                     str(job)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                    stderr=logs[-1], text=True))
                for w in workers:
                    if w.stdout.readline().strip() != "ready":
                        raise RuntimeError(f"a client worker did not start: {_tail(Path(tmp), workers.index(w))}")
                t0 = clock() + 0.05
                for w in workers:
                    w.stdin.write(f"go {t0!r}\n")
                    w.stdin.close()
                limit = time.monotonic() + (until or 0) + timeout + 120
                for p, w in enumerate(workers):
                    try:
                        w.wait(timeout=max(1.0, limit - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        w.kill()
                        w.wait()
                    result = Path(tmp) / f"out{p}.json"
                    if w.returncode == 0 and result.is_file():
                        outs.append(json.loads(result.read_text()))
                    else:
                        failures.append(f"worker {p} exited with {w.returncode}: {_tail(Path(tmp), p)}")
            finally:
                for w in workers:
                    if w.poll() is None:
                        w.kill()
                        w.wait()
                for log in logs:
                    log.close()
    records = sorted((r for o in outs for r in o["records"]), key=lambda r: r["sent"])
    stats = [o["stats"] for o in outs]
    wall = max((s["wall_s"] for s in stats), default=0.0)
    client = {"procs": len(shares) if procs else 0, "loop": stats[0]["loop"] if stats else None,
              "cpu_s": sum(s["cpu_s"] for s in stats),
              "cpu_util_max": max((s["cpu_s"] / s["wall_s"] for s in stats if s["wall_s"] > 0), default=None),
              "connections": sum(s.get("connections", 0) for s in stats),
              "stale_retries": sum(s.get("stale_retries", 0) for s in stats), "wall_s": wall}
    if failures:
        client["failures"] = failures
    row = {"clients": clients, "requests": len(records), "planned_requests": n, "rate": rate,
           "stopped_by_time": bool(until) and len(records) < n, "level_seconds": until or None,
           **summarize(records, clients), "client": client}
    # the client's CPU cost of a token (its processes together): procs / this = what they could stream at most
    client["us_per_token"] = 1e6 * client["cpu_s"] / row["completion_tokens"] if row["completion_tokens"] else None
    if keep_records:
        row["records"] = records
    return row


def _tail(folder: Path, p: int) -> str:
    try:
        return (folder / f"err{p}.txt").read_text()[-800:].strip() or "(no stderr)"
    except OSError:
        return "(no stderr)"


# ---------------------------------------------------------------------------------------------------- summaries
def steady_tokens_per_s(records: list, clients: int):
    """Tokens/s while every client was streaming: from the moment the ``clients``-th first token arrived to the
    ``clients``-th latest end (when the load starts to drain); each request's tokens spread evenly from its first
    token to its end. None where that window is under 0.5 s or a fifth of the level."""
    ok = [r for r in records if r["ok"] and "first" in r and (r.get("tokens") or 0) > 0]
    if len(ok) < clients or not ok:
        return None
    firsts = sorted(r["first"] for r in ok)
    ends = sorted(r["end"] for r in ok)
    a, b = firsts[clients - 1], ends[-clients]
    wall = ends[-1] - min(r["sent"] for r in ok)
    if b - a < max(0.5, 0.2 * wall):
        return None
    total = 0.0
    for r in ok:
        f, e, k = r["first"], r["end"], r["tokens"]
        total += a <= f <= b
        if k > 1 and e > f:
            total += (k - 1) * max(0.0, min(e, b) - max(f, a)) / (e - f)
    return total / (b - a)


def summarize(records: list, clients: int | None = None) -> dict:
    ok = [r for r in records if r["ok"]]
    wall = max((r["end"] for r in records), default=0.0) - min((r["sent"] for r in records), default=0.0)
    tokens = sum(r["tokens"] or 0 for r in ok)
    chunks = sum(r.get("chunks", 0) for r in ok)
    reads = sum(r.get("reads", 0) for r in ok)
    ttft = [r["first"] - r["sent"] for r in ok if "first" in r]
    itl = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in ok if "first" in r and (r["tokens"] or 0) > 1]
    gaps = [g for r in ok for g in r["gaps"]]
    errors = collections.Counter(r["error"].split(":", 1)[0] for r in records if "error" in r)
    return {"ok": len(ok), "errors": len(records) - len(ok), "wall_s": wall, "completion_tokens": tokens,
            "throughput_tok_s": tokens / wall if wall > 0 else None, "requests_per_s": len(ok) / wall if wall else None,
            "steady_tok_s": steady_tokens_per_s(records, clients) if clients else None,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
            "chunk_gap_p50_s": percentile(gaps, 50), "chunk_gap_p99_s": percentile(gaps, 99),
            "tokens_per_chunk": tokens / chunks if chunks else None,
            "chunks_per_read": chunks / reads if reads else None,
            "no_usage": sum(r["tokens"] is None for r in ok),
            "finish": {k: sum(r.get("finish") == k for r in records) for k in ("stop", "length", "abort", None)},
            "error_kinds": dict(errors),
            "error_samples": sorted({r["error"] for r in records if "error" in r})[:3]}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2]))
    sys.exit("usage: load_client.py --worker JOB.json (started by serve_load.py)")
