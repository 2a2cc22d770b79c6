"""The servers ``bench/scripts/serve_load.py`` starts die with it: a parent that starts a sleeping child the way the
script starts a server (``spawn_tied``) is killed (SIGKILL: nothing of it runs; SIGTERM: a ``timeout``), and the
child must be gone within seconds instead of holding its GPU memory."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "scripts" / "serve_load.py"
PARENT = f"""
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("serve_load", {str(SCRIPT)!r})
load = importlib.util.module_from_spec(spec)
spec.loader.exec_module(load)
child = load.spawn_tied([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that no one has reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_spawned_server_dies_with_its_parent(sig):
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert _running(child)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        end = time.monotonic() + 10
        while _running(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _running(child), f"the child {child} outlived its parent (signal {sig.name})"
    finally:
        parent.kill()
        parent.wait()
