"""An OpenAI-shaped streaming stub server: the load generator's own ceiling (``serve_load.py --stub-check``).

``python bench/scripts/stub_server.py --port P --procs K --token-ms 1 [--model stub]`` forks K processes that each
listen on P (SO_REUSEPORT: the kernel spreads the connections) and run one asyncio loop with a bare HTTP/1.1
protocol, no framework. ``POST /v1/chat/completions`` and ``/v1/completions`` with ``stream: true`` answer a
chunked SSE stream of ``max_tokens`` tokens, one every ``--token-ms`` ms per stream (token k is due k + 1 intervals
after the request; a 1 ms timer per process sends every stream's due tokens in one write), then a usage chunk and
``data: [DONE]``; the chunks are built once at start, so a token costs a slice of a prebuilt table. Without
``stream`` the whole answer comes at once. ``GET /health``, ``/v1/models`` and ``/metrics`` (this process's
counters: the connection decides which process answers).

Failures on purpose, for the client's tests: a prompt containing ``STUB-ERROR`` gets HTTP 400 with an OpenAI-style
JSON error body; ``STUB-DROP`` resets the connection after 3 tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time

TABLE = 8192                # tokens whose chunks are prebuilt: the longest request the stub answers


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


def token_text(k: int) -> str:
    return f"t{k} "


class Tables:
    """Prebuilt HTTP chunks: per endpoint, token k's chunk (and with finish_reason 'length' when it is the last)."""

    def __init__(self, model: str):
        self.model = model
        self.chat, self.chat_last, self.text, self.text_last = [], [], [], []
        for k in range(TABLE):
            for last in (False, True):
                reason = "length" if last else None
                chat = {"id": "stub", "object": "chat.completion.chunk", "created": 0, "model": model,
                        "choices": [{"index": 0, "delta": {"content": token_text(k)}, "finish_reason": reason}]}
                text = {"id": "stub", "object": "text_completion", "created": 0, "model": model,
                        "choices": [{"index": 0, "text": token_text(k), "finish_reason": reason}]}
                (self.chat_last if last else self.chat).append(_event(chat))
                (self.text_last if last else self.text).append(_event(text))
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")

    def usage(self, chat: bool, prompt_tokens: int, n: int) -> bytes:
        return _event({"id": "stub", "object": "chat.completion.chunk" if chat else "text_completion", "created": 0,
                       "model": self.model, "choices": [],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                 "total_tokens": prompt_tokens + n}})


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"Error")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (status, reason, ctype, len(body))
            + body)


class Stream:
    __slots__ = ("proto", "start", "n", "sent", "chat", "prompt_tokens", "drop")

    def __init__(self, proto, n, chat, prompt_tokens, drop):
        self.proto, self.start, self.n, self.sent = proto, time.monotonic(), n, 0
        self.chat, self.prompt_tokens, self.drop = chat, prompt_tokens, drop


class Stub:
    """One process's server state: the tables, the live streams and the ticker that feeds them."""

    def __init__(self, model: str, token_ms: float):
        self.tables, self.interval = Tables(model), token_ms / 1000.0
        self.streams: set = set()
        self.ticking = False
        self.counters = {"stub_requests_total": 0, "stub_streamed_tokens_total": 0, "stub_errors_total": 0}

    def add(self, stream):
        self.streams.add(stream)
        if not self.ticking:
            self.ticking = True
            asyncio.get_running_loop().call_later(self.interval, self.tick)

    def tick(self):
        now, t, iv = time.monotonic(), self.tables, self.interval
        done = []
        for s in self.streams:
            transport = s.proto.transport
            if transport is None or transport.is_closing():
                done.append(s)
                continue
            due = min(s.n, int((now - s.start) / iv))
            if due <= s.sent:
                continue
            body, last = (t.chat, t.chat_last) if s.chat else (t.text, t.text_last)
            if s.drop and due >= 3:
                transport.write(b"".join(body[s.sent:3]))
                transport.abort()
                s.proto.transport = None
                done.append(s)
                continue
            out = b"".join(body[s.sent:min(due, s.n - 1)])
            if due == s.n:
                out += last[s.n - 1] + t.usage(s.chat, s.prompt_tokens, s.n) + t.done
                done.append(s)
            self.counters["stub_streamed_tokens_total"] += due - s.sent
            s.sent = due
            transport.write(out)
        for s in done:
            self.streams.discard(s)
            s.proto.stream = None
            s.proto.next_request()
        if self.streams:
            asyncio.get_running_loop().call_later(max(0.0, iv - (time.monotonic() - now)), self.tick)
        else:
            self.ticking = False


class Protocol(asyncio.Protocol):
    def __init__(self, stub: Stub):
        self.stub, self.transport, self.buf, self.stream = stub, None, b"", None

    def connection_made(self, transport):
        self.transport = transport
        try:    # asyncio sets it only on sockets made with proto IPPROTO_TCP (not this listener's): Nagle held
                # a stream's second chunk for the client's delayed ACK, 40 ms
            transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (AttributeError, OSError):
            pass

    def connection_lost(self, exc):
        self.transport = None

    def data_received(self, data):
        self.buf += data
        if self.stream is None:
            self.next_request()

    def next_request(self):
        """Answer the buffered requests in turn (a stream holds the next one back until it ends)."""
        while self.stream is None and self.transport is not None:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").split("\r\n")
            length = 0
            for line in head[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body, self.buf = self.buf[end + 4:end + 4 + length], self.buf[end + 4 + length:]
            method, path = (head[0].split(" ") + ["", ""])[:2]
            self.handle(method, path.split("?", 1)[0], body)

    def handle(self, method: str, path: str, body: bytes):
        stub, t = self.stub, self.stub.tables
        if method == "GET" and path == "/health":
            self.transport.write(_response(200, b"ok", b"text/plain"))
        elif method == "GET" and path == "/v1/models":
            self.transport.write(_response(200, json.dumps({"object": "list", "data": [
                {"id": t.model, "object": "model", "owned_by": "stub"}]}).encode()))
        elif method == "GET" and path == "/metrics":
            text = "".join(f"{k} {v}\n" for k, v in stub.counters.items())
            self.transport.write(_response(200, text.encode(), b"text/plain"))
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            stub.counters["stub_requests_total"] += 1
            chat = path.endswith("chat/completions")
            try:
                req = json.loads(body)
                prompt = (req["messages"][-1]["content"] if chat else req["prompt"])
                n = int(req.get("max_tokens") or 16)
                if not 1 <= n <= TABLE:
                    raise ValueError(f"max_tokens must be in 1..{TABLE}")
            except (ValueError, KeyError, TypeError, IndexError) as err:
                return self.error(400, f"stub: bad request body: {err}")
            if "STUB-ERROR" in prompt:
                return self.error(400, "stub: this prompt is rejected on purpose (STUB-ERROR)")
            prompt_tokens = max(1, len(prompt) // 4)
            if req.get("stream"):
                self.transport.write(t.head)
                self.stream = Stream(self, n, chat, prompt_tokens, "STUB-DROP" in prompt)
                stub.add(self.stream)
            else:
                text = "".join(token_text(k) for k in range(n))
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "finish_reason": "length"})
                out = {"id": "stub", "object": "chat.completion" if chat else "text_completion", "created": 0,
                       "model": t.model, "choices": [choice],
                       "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                 "total_tokens": prompt_tokens + n}}
                stub.counters["stub_streamed_tokens_total"] += n
                self.transport.write(_response(200, json.dumps(out).encode()))
        else:
            self.error(404, f"stub: no route {method} {path}")

    def error(self, status: int, message: str):
        self.stub.counters["stub_errors_total"] += 1
        body = json.dumps({"error": {"message": message, "type": "BadRequestError" if status == 400 else
                                     "NotFoundError", "param": None, "code": status}}).encode()
        self.transport.write(_response(status, body))


def serve_one(host: str, port: int, model: str, token_ms: float) -> None:
    """One process: listen on ``port`` with SO_REUSEPORT and serve until killed."""
    if sys.platform.startswith("linux"):
        import ctypes
        import ctypes.util
        ctypes.CDLL(ctypes.util.find_library("c")).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.setblocking(False)
    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    stub = Stub(model, token_ms)
    server = loop.run_until_complete(loop.create_server(lambda: Protocol(stub), sock=sock, backlog=4096))
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    try:
        loop.run_forever()
    finally:
        server.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--procs", type=int, default=max(1, min(4, (os.cpu_count() or 2) // 4)))
    p.add_argument("--token-ms", type=float, default=1.0, help="ms between two tokens of one stream")
    p.add_argument("--model", default="stub")
    args = p.parse_args(argv)
    children = []
    for _ in range(max(1, args.procs)):
        pid = os.fork()
        if pid == 0:
            try:
                serve_one(args.host, args.port, args.model, args.token_ms)
            finally:
                os._exit(0)
        children.append(pid)

    def stop(*_):
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    signal.signal(signal.SIGTERM, lambda *a: (stop(), sys.exit(0)))
    signal.signal(signal.SIGINT, lambda *a: (stop(), sys.exit(0)))
    status = 0
    for pid in children:
        _, code = os.waitpid(pid, 0)
        status = status or os.waitstatus_to_exitcode(code)
    return status


if __name__ == "__main__":
    sys.exit(main())
