"""Hub ids fail fast without network (``tilespec.models.hub``, ``loading._load_hub``); no test touches the network:
urllib's ``urlopen`` and transformers' ``from_pretrained`` are replaced by stubs.

* The offline switches answer at once; a refused / failing request and a hanging one end the probe within its
  timeout; any HTTP answer (even 404) counts as reachable.
* ``load("nosuchmodel")`` and ``tilespec generate --target nosuchmodel`` end in one clear error within 2 s when the
  hub hangs, and only the local cache was asked (``local_files_only=True``).
* A hub id found in the local cache loads without a probe; with a reachable hub the online load runs as before.
"""
from __future__ import annotations

import time
import urllib.error

import pytest

from test_bad_inputs_cli import one_error_line, run_cli
from tilespec.models import hub, load


@pytest.fixture
def calls(monkeypatch):
    """transformers' AutoConfig.from_pretrained recording its keyword arguments: a cache miss (OSError)."""
    import transformers
    seen = []

    def config(src, **kw):
        seen.append(kw)
        raise OSError(f"{src} is not a local folder and is not a valid model identifier")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", config)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    return seen


def _urlopen(behaviour):
    def fake(request, timeout):
        assert request.get_method() == "HEAD" and timeout == hub.PROBE_TIMEOUT
        if behaviour == "hang":
            time.sleep(30)
        if behaviour == "404":
            raise urllib.error.HTTPError(request.full_url, 404, "Not Found", {}, None)
        if behaviour == "dns":
            raise urllib.error.URLError("[Errno -2] Name or service not known")
        raise AssertionError("the probe must not be called here")
    return fake


@pytest.mark.parametrize("name", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_switch_answers_without_a_request(monkeypatch, calls, name):
    monkeypatch.setattr(hub.urllib.request, "urlopen", _urlopen("never"))
    monkeypatch.setenv(name, "1")
    assert hub.unreachable() == f"{name} is set"


def test_probe_outcomes(monkeypatch, calls):
    monkeypatch.setattr(hub.urllib.request, "urlopen", _urlopen("404"))
    assert hub.unreachable() is None
    monkeypatch.setattr(hub.urllib.request, "urlopen", _urlopen("dns"))
    assert "Name or service not known" in hub.unreachable()
    monkeypatch.setattr(hub.urllib.request, "urlopen", _urlopen("hang"))
    monkeypatch.setattr(hub, "PROBE_TIMEOUT", 0.2)
    start = time.monotonic()
    assert hub.unreachable() == "no answer from https://huggingface.co within 0.2 s"
    assert time.monotonic() - start < 10.0       # the probe's timeout, not the 30 s the fake host hangs


@pytest.mark.usefixtures("home")
def test_unknown_name_without_network_fails_fast(monkeypatch, calls):
    monkeypatch.setattr(hub.urllib.request, "urlopen", _urlopen("hang"))
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="the hub cannot be reached .no answer from"):
        load("nosuchmodel")
    assert time.monotonic() - start < 2.5                  # PROBE_TIMEOUT 1.5 s + 0.1 s, then the error
    assert calls == [{"local_files_only": True}]          # the local cache only: no hub request with retries


@pytest.mark.usefixtures("home")
def test_cli_generate_unknown_name_offline_is_one_quick_line(monkeypatch, capsys, calls):
    monkeypatch.setattr(hub.urllib.request, "urlopen", _urlopen("never"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    rc, err = run_cli(["generate", "--target", "nosuchmodel", "--prompt", "hi"], capsys)
    assert time.monotonic() - start < 10.0      # no hub retries (they took 26-40 s); CLI imports may be cold
    assert rc == 1
    line = one_error_line(err)
    assert "unknown model 'nosuchmodel'" in line and "HF_HUB_OFFLINE is set" in line


def test_cached_hub_id_loads_without_a_probe(monkeypatch):
    import transformers
    from test_models import _tiny_qwen
    model, seen = _tiny_qwen(), []

    class Cfg:
        model_type = "qwen2"
    monkeypatch.setattr(hub, "unreachable", lambda *a: pytest.fail("probed the hub for a cached id"))
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda src, **k: seen.append(k) or Cfg())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda src, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda src, **k: "T")
    assert load("someone/cached-model")[0] is model and seen == [{"local_files_only": True}]


def test_reachable_hub_takes_the_online_load(monkeypatch, calls):
    monkeypatch.setattr(hub, "unreachable", lambda *a: None)
    with pytest.raises(FileNotFoundError, match="could not load 'someone/missing'"):
        load("someone/missing")
    assert calls == [{"local_files_only": True}, {}]
