"""Fail fast on hub ids when the Hugging Face hub cannot be reached.

transformers retries a hub request several times with back-off before giving up, which took 26-40 s on a machine
without network before ``load()`` could say that a name is unknown. :func:`unreachable` answers "can the hub be
reached at all?" within PROBE_TIMEOUT seconds: the offline switches (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)
answer at once; otherwise one HEAD request to the hub endpoint (``HF_ENDPOINT``, proxies from the environment as
urllib reads them), run in a daemon thread so that a hanging DNS lookup cannot hold the caller past the timeout.
Any HTTP answer, even an error status, means reachable.
"""
from __future__ import annotations

import os
import threading
import urllib.error
import urllib.request
from typing import Optional

PROBE_TIMEOUT = 1.5        # seconds
_TRUE = {"1", "true", "yes", "on"}


def endpoint() -> str:
    """The hub's base URL (``HF_ENDPOINT`` or https://huggingface.co)."""
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def offline_switch() -> Optional[str]:
    """The name of the environment variable that turns the hub off, if one is set."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return name
    return None


def _head(url: str, timeout: float, out: list) -> None:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
        out.append(None)
    except urllib.error.HTTPError:          # the hub answered (an error status still means reachable)
        out.append(None)
    except Exception as err:                 # DNS failure, refused connection, timeout, proxy error, ...
        out.append(f"{type(err).__name__}: {getattr(err, 'reason', err)}")


def unreachable(timeout: Optional[float] = None) -> Optional[str]:
    """None when the hub answers within ``timeout`` seconds (default PROBE_TIMEOUT), else why not (one line). Never
    takes much longer than ``timeout``: the request runs in a daemon thread that is abandoned if it has not
    finished."""
    timeout = PROBE_TIMEOUT if timeout is None else timeout
    switch = offline_switch()
    if switch:
        return f"{switch} is set"
    url, out = endpoint(), []
    worker = threading.Thread(target=_head, args=(url, timeout, out), daemon=True, name="tilespec-hub-probe")
    worker.start()
    worker.join(timeout + 0.1)
    if not out:
        return f"no answer from {url} within {timeout:g} s"
    return None if out[0] is None else f"{url}: {out[0]}"
