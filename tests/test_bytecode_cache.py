"""``import tilespec`` keeps compiled bytecode under its home when Python will not write it beside the installed
sources (tilespec.env.cache_bytecode_in_home): otherwise every process compiles torch's and transformers' imports
from source at every start."""
import os
import subprocess
import sys

PROBE = "import sys, os, tilespec; print(sys.pycache_prefix, sys.dont_write_bytecode, os.environ.get('PYTHONPYCACHEPREFIX'))"


def _probe(tmp_path, **env) -> list:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, "TILESPEC_HOME": str(tmp_path), **env},
                         capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_told_not_to_write_bytecode_it_goes_under_the_home_and_to_the_processes_spawned(tmp_path):
    prefix, dont, inherited = _probe(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert prefix == str(tmp_path / "pycache") == inherited
    assert dont == "False" and (tmp_path / "pycache").is_dir()


def test_an_explicit_prefix_is_kept(tmp_path):
    mine = tmp_path / "mine"
    prefix, _, inherited = _probe(tmp_path, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(mine))
    assert prefix == str(mine) == inherited
    assert not (tmp_path / "pycache").exists()


def test_where_python_writes_beside_the_sources_nothing_changes(tmp_path):
    import importlib.util
    from pathlib import Path
    beside = Path(importlib.util.find_spec("torch").origin).parent / "__pycache__"
    if not os.access(beside if beside.exists() else beside.parent, os.W_OK):
        import pytest
        pytest.skip("this interpreter cannot write beside torch's sources")
    prefix, dont, _ = _probe(tmp_path)
    assert prefix == "None" and dont == "False"
