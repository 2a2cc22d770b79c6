"""tilespec.settings: the one place that reads TILESPEC_* variables, typed and validated."""
import pathlib
import re

import pytest

from tilespec import settings

SRC = pathlib.Path(settings.__file__).parent


def test_defaults_and_parsing(tmp_path):
    s = settings.parse({})
    assert s.home == pathlib.Path.home() / ".cache" / "tilespec" and s.data == s.home / "data"
    assert s.run_ahead and s.direct_launch and s.native_kernels is None and s.sdpa == "" and s.commit is None
    s = settings.parse({"TILESPEC_HOME": str(tmp_path), "TILESPEC_RUN_AHEAD": "off", "TILESPEC_SDPA": " CUDNN, math",
                        "TILESPEC_NATIVE_KERNELS": ""})
    assert s.home == tmp_path and s.data == tmp_path / "data" and not s.run_ahead
    assert s.sdpa == "cudnn,math" and s.native_kernels == "" and not s.tp_check and s.tp_allreduce is None


@pytest.mark.parametrize("name, value, match", [("TILESPEC_RUN_AHEAD", "maybe", "TILESPEC_RUN_AHEAD='maybe'"),
                                                ("TILESPEC_DIRECT_LAUNCH", "2", "expected one of"),
                                                ("TILESPEC_SDPA", "flash,fast", "unknown back-end"),
                                                ("TILESPEC_TP_ALLREDUCE", "gloo", "symm or nccl")])
def test_bad_values_name_the_variable(name, value, match, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        settings.get()


def test_get_follows_the_environment_and_configure(monkeypatch, tmp_path):
    monkeypatch.setenv("TILESPEC_DATA", str(tmp_path))
    assert settings.get().data == tmp_path
    monkeypatch.setenv("TILESPEC_RUN_AHEAD", "0")
    assert settings.get().run_ahead is False and settings.get() is settings.get()
    settings.configure(native_flex=True)
    try:
        assert settings.get().native_flex and not settings.get().compiled_prefill and not settings.get().tp_check
        with pytest.raises(TypeError, match="unknown setting"):
            settings.configure(flex=True)
    finally:
        settings.configure()
    assert not settings.get().native_flex
    settings.configure(tp_check=True)      # the tensor-parallel debugging check: from Python, not the environment
    try:
        assert settings.get().tp_check
    finally:
        settings.configure()


def test_no_other_module_reads_a_tilespec_variable():
    pattern = re.compile(r"""environ(?:\.get)?[(\[]\s*["']TILESPEC_""")
    readers = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text())]
    assert readers == [], readers
    assert len(settings.VARIABLES) <= 11     # ten engine settings and the server's API key
