"""Integrity of cache entries: the files fetched (listed in ``tilespec.json``) and the files converted later
(``hf-<dtype>/`` of a GGUF entry, listed in ``hf-<dtype>/tilespec-converted.json`` when the conversion is saved).

Two levels, by cost:
  * ``quick`` (every load, ``models list``, ``models fetch``): every listed file exists and has its size (a stat),
    and files modified after their record was written are hashed again (an edit in place changes the mtime);
  * ``full`` (``tilespec models verify``): every file is hashed (sha256 at ~1-2 GB/s: seconds for a 1.5B model),
    which also finds damage that kept the size and the mtime.
A damaged converted folder is re-creatable from the entry's GGUF file: loads and fetches convert it again (with a
message). A damaged fetched file makes ``models fetch`` fetch the entry again (with a message) and loads fail with
ChecksumError naming that command.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .cache import ChecksumError, is_cached, model_dir, sha256_file
from .registry import get_entry

RECORD = "tilespec-converted.json"


def file_records(folder: Path) -> dict:
    """{relative path: {size, sha256}} of every file under ``folder`` but the records themselves."""
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in ("tilespec.json", RECORD)}


def record_converted(folder: Path) -> None:
    """Write ``folder/tilespec-converted.json`` listing the size and sha256 of every file of a fresh conversion."""
    (folder / RECORD).write_text(json.dumps({"files": file_records(folder)}, indent=1) + "\n")


def check_files(folder: Path, files: dict, written_ns: int, full: bool = False) -> str | None:
    """None when every file of ``files`` ({rel: {size, sha256}}) under ``folder`` is intact, else what is wrong.
    ``full``: hash every file; otherwise only those modified after ``written_ns`` (the record's mtime)."""
    for rel, info in files.items():
        path = folder / rel
        if not path.is_file():
            return f"{path} is missing"
        stat = path.stat()
        if stat.st_size != info["size"]:
            return f"{path} has {stat.st_size} B, expected {info['size']} B"
        if (full or stat.st_mtime_ns > written_ns) and sha256_file(path) != info["sha256"]:
            return f"{path} no longer has the sha256 recorded when it was written"
    return None


def converted_problem(folder: Path, full: bool = False, adopt: bool = False) -> str | None:
    """What is wrong with a converted folder (``hf-<dtype>/``), or None. A folder converted before records existed
    is trusted as it is; ``adopt`` writes its record then (one hash pass: loads and ``models verify`` do, while
    ``models list`` and ``models fetch`` stay at a stat per file)."""
    record = folder / RECORD
    if not record.is_file():
        if not (folder / "config.json").is_file():
            return f"{folder / 'config.json'} is missing"
        if adopt:
            record_converted(folder)
        return None
    files = json.loads(record.read_text())["files"]
    problem = check_files(folder, files, record.stat().st_mtime_ns, full)
    if problem is None and not full:
        _restamp(record, folder, files)
    return problem


def _restamp(record: Path, folder: Path, files: dict) -> None:
    """After a quick check re-hashed files newer than the record (and found them intact, e.g. copied), move the
    record's mtime past them so later loads skip the hash."""
    newest = max((os.stat(folder / rel).st_mtime_ns for rel in files), default=0)
    if newest > record.stat().st_mtime_ns:
        stamp = max(time.time_ns(), newest)
        try:
            os.utime(record, ns=(stamp, stamp))
        except OSError:
            pass


def entry_problems(name: str, full: bool = False) -> list[str]:
    """Everything wrong with the cached entry ``name`` (empty when intact or not cached): fetched files first
    (``fetched: ...``), then converted folders (``converted hf-<dtype>: ...``)."""
    from .cache import verify_cached
    if not is_cached(name):
        return []
    folder = model_dir(name)
    out = []
    try:
        if full:
            manifest = folder / "tilespec.json"
            files = json.loads(manifest.read_text()).get("files")
            if files is None:
                entry = get_entry(name)
                files = {entry.source_name: {"size": entry.size, "sha256": entry.sha256}}
            problem = check_files(folder, files, manifest.stat().st_mtime_ns, full=True)
            if problem:
                raise ChecksumError(problem)
        else:
            verify_cached(name)
    except ChecksumError as err:
        out.append(f"fetched: {err}")
    for conv in sorted(folder.glob("hf-*")):
        if conv.is_dir() and (problem := converted_problem(conv, full, adopt=full)):
            out.append(f"converted {conv.name}: {problem}")
    return out


def cache_state(name: str) -> str:
    """``models list``'s word for an entry: "no", "yes" or "damaged" (quick check)."""
    if not is_cached(name):
        return "no"
    return "damaged" if entry_problems(name) else "yes"
