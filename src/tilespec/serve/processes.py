"""The server's processes: the engine process, the main API process, and extra API processes beside it.

    main process (API 0) --------+--- Submit / Cancel ---> engine process (serve/core.py: GPU, scheduler, steps)
    API processes 1..N-1 --------+                              |
      ^  one Step message per engine step to each API process   |
      +---------------------------------------------------------+

:class:`EngineProcess` (in the main process) makes the private ipc addresses, starts the engine process and watches
it: when it dies the main process sends Failed to every API process on its behalf, so their requests end at once.
:func:`run_server` serves HTTP: the main process is API process 0, and an engine made for N > 1 has API processes
1..N-1 serve the same port (each its own SO_REUSEPORT socket: the kernel spreads the connections), so detokenizing,
SSE encoding and HTTP work spread over several cores while one engine steps. Those start with the engine process,
not after it: their imports, the tokenizer (the engine's Loaded) and their heap's freeze happen while the engine
loads and warms up; they learn where to listen over a pipe (:meth:`EngineProcess.start_api_servers`) and listen
once the engine is ready. Every process started here dies with the main one (PR_SET_PDEATHSIG, then terminate /
kill at exit): none outlives the server holding GPU memory.
"""
from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import shutil
import socket
import tempfile
import time

import zmq

from .client import EngineClient
from .core import EngineSpec, _die_with_parent, freeze_heap, push_socket, run_engine
from .cpus import keep_off
from .messages import Failed, Shutdown, encode
from .timeline import Marks, startup_line

SPAWN = multiprocessing.get_context("spawn")     # CUDA does not survive fork


class EngineProcess:
    """The engine process built from ``spec``, with outboxes for ``api_servers`` API processes."""

    def __init__(self, spec: EngineSpec, api_servers: int = 1, marks: Marks | None = None):
        if not (isinstance(api_servers, int) and api_servers >= 1):
            raise ValueError(f"api_servers must be an integer >= 1, got {api_servers!r}")
        self.marks = Marks() if marks is None else marks        # the main process's start-up timeline
        self.dir = tempfile.mkdtemp(prefix="tilespec-ipc-")
        self.inbox = f"ipc://{self.dir}/engine"
        self.outboxes = [f"ipc://{self.dir}/api-{i}" for i in range(api_servers)]
        self._zmq = zmq.Context()
        self._control = push_socket(self._zmq, self.inbox)
        self._notify = [push_socket(self._zmq, address) for address in self.outboxes]
        self.process = SPAWN.Process(target=run_engine, args=(spec, self.inbox, self.outboxes, os.getpid()),
                                     name="tilespec-engine")
        with spec.portable():
            self.process.start()
        self.marks.mark("engine spawned")
        self.api_processes: list = []
        self._pipes: list = []          # per API process 1..N-1: the main's end of its pipe
        self.api_marks: list = []       # their start-up timelines, once they listen
        self.engine_marks, self.log = None, None     # the engine's timeline (in Ready); where serving() logs
        self._stopping = False
        atexit.register(self.kill)
        for index in range(1, api_servers):     # beside the engine's start: see the module docstring
            ours, theirs = SPAWN.Pipe()
            proc = SPAWN.Process(target=run_api_server, name=f"tilespec-api-{index}",
                                 args=(self.inbox, self.outboxes[index], index, api_servers, os.getpid(), theirs))
            proc.start()
            theirs.close()
            self.api_processes.append(proc)
            self._pipes.append(ours)
        if api_servers > 1:
            self.marks.mark("API processes spawned")

    def client(self, index: int = 0, max_queue: int = 256) -> EngineClient:
        """API process ``index``'s client (in this process: index 0)."""
        return EngineClient(self.inbox, self.outboxes[index], index=index, count=len(self.outboxes),
                            max_queue=max_queue, engine_alive=self.process.is_alive)

    def watch(self) -> None:
        """In the running event loop: tell every API process at once if the engine process dies."""
        asyncio.get_running_loop().add_reader(self.process.sentinel, self._exited)

    def serving(self) -> None:
        """The main process serves (its app's start-up ran): the start-up timeline goes to ``log``, once."""
        if self.log is not None and self.marks.marks[-1][0] != "serving":
            self.marks.mark("serving")
            self.log(startup_line(self.marks, self.engine_marks, self.api_marks))

    def _exited(self) -> None:
        asyncio.get_running_loop().remove_reader(self.process.sentinel)
        if not self._stopping:
            self.process.join(1)
            failed = encode(Failed(error=f"the engine process exited with code {self.process.exitcode}"))
            for sock in self._notify:
                sock.send(failed)

    def start_api_servers(self, options: dict, host: str, port: int, log_level: str, timeout: float = 300) -> None:
        """API processes 1..N-1 serve ``host:port`` with the app options of the main one; returns once every one
        listens. Clients keep their connections, and the kernel spreads connections only over sockets already
        listening: had the main process accepted before the others listened, it would have kept every client."""
        for pipe in self._pipes:
            pipe.send((options, host, port, log_level))
        end = time.monotonic() + timeout
        for proc, pipe in zip(self.api_processes, self._pipes):
            while not pipe.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} before it listened (its "
                                       f"output above says why)")
                if time.monotonic() > end:
                    raise TimeoutError(f"{proc.name} did not listen within {timeout} s")
            self.api_marks.append(pipe.recv())
        if self._pipes:
            self.marks.mark("API processes listen")

    async def stop(self) -> None:
        """The API processes end, then the engine: Shutdown (it cancels what runs), else terminate, then kill."""
        self._stopping = True
        for proc in self.api_processes:
            proc.terminate()
        if self.process.is_alive():
            self._control.send(encode(Shutdown()))
            await asyncio.to_thread(self.process.join, 10)
        await asyncio.to_thread(self.kill)

    def kill(self) -> None:
        """Every process started here ends now (terminate, then kill); the sockets are released. Safe twice."""
        self._stopping = True
        for proc in [*self.api_processes, self.process]:
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if not self._zmq.closed:
            for sock in (self._control, *self._notify):
                sock.close(linger=0)
            self._zmq.term()
        shutil.rmtree(self.dir, ignore_errors=True)
        atexit.unregister(self.kill)


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT, so several API processes can serve one port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if hasattr(socket, "SO_REUSEPORT"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn(app, log_level: str, shutdown_timeout: float):
    import uvicorn
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                                         timeout_graceful_shutdown=int(shutdown_timeout)))


def main_server(app, host: str, port: int, *, log_level: str = "info") -> tuple:
    """(uvicorn server, socket) of the main API process for ``app`` (from serve.serve_engine) on ``host:port``, the
    other API processes started (as many as the engine has outboxes): ``server.run(sockets=[sock])`` serves until
    interrupted or ``server.should_exit`` is set."""
    sock = listening_socket(host, port)
    app.state.engine.start_api_servers(app.state.api_options, host, port, log_level)
    return _uvicorn(app, log_level, app.state.api_options["shutdown_timeout"]), sock


def run_server(app, host: str, port: int, *, log_level: str = "info") -> None:
    """Serve ``app`` on ``host:port`` until interrupted (:func:`main_server`)."""
    server, sock = main_server(app, host, port, log_level=log_level)
    freeze_heap()           # the API process's start-up objects too (the tokenizer, the app)
    app.state.engine.marks.mark("app frozen")
    server.run(sockets=[sock])


def run_api_server(inbox: str, outbox: str, index: int, count: int, parent: int, pipe) -> None:
    """API process ``index``'s main (spawn target), started with the engine process: the imports, its client, the
    tokenizer (the engine's Loaded) and its heap's freeze while the engine warms up; then, with the app options and
    the address from ``pipe`` and the engine ready, the app and uvicorn on its own socket. It tells ``pipe`` (its
    start-up marks) once that socket listens. An engine that fails to start ends it quietly: the main process
    reports why."""
    _die_with_parent(parent)
    marks = Marks()
    from .app import build_app
    from .structured import preload_beside
    marks.mark("imports")
    client = EngineClient(inbox, outbox, index=index, count=count)
    try:
        client.wait_ready(loaded_only=True)
        marks.mark("tokenizer")
        preload_beside()
        freeze_heap()               # the imports and the tokenizer: the bulk of its heap, frozen beside the warm-up
        info = client.wait_ready()
    except (RuntimeError, ValueError, TypeError, FileNotFoundError):
        os._exit(1)
    keep_off(frozenset(info.get("engine_cpus", ())))       # the engine's step loop has that core to itself
    marks.mark("engine ready")
    options, host, port, log_level = pipe.recv()
    options = dict(options)
    client.max_queue = options.pop("max_queue")
    app = build_app(client, tokenizer=client.tokenizer, **options)
    freeze_heap()
    sock = listening_socket(host, port)     # connections queue in its backlog from here on
    marks.mark("listening")
    pipe.send(marks.to_wire())
    _uvicorn(app, log_level, options["shutdown_timeout"]).run(sockets=[sock])
