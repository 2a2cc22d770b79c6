"""Split a cache entry into numbered parts of at most 60 MiB (for machines that take small uploads and have no
network) and join them back on the other side, verifying every part and every file by sha256.

``pack(name, parts_dir)`` writes ``<name>.manifest.json`` and ``<name>.part001``, ``<name>.part002``, ... into
``parts_dir``. The parts are consecutive slices of one byte stream: the entry's files, concatenated in manifest
order. The manifest lists ``files`` (relative path, size, sha256) and ``parts`` (file name, size, sha256).
``unpack(parts_dir)`` verifies, rebuilds every file and publishes the entry into the cache atomically.
Invariant: ``unpack(pack(x))`` reproduces the packed files byte for byte, or raises ChecksumError.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .cache import CHUNK, ChecksumError, model_dir, model_path, publish, sha256_file, tilespec_home
from .registry import get_entry

MAX_PART = 60 * 1024 * 1024
FORMAT = "tilespec-pack-1"


def _entry_files(root: Path, include_converted: bool) -> list[Path]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    if not include_converted:   # hf-<dtype>/ folders are re-creatable from model.gguf on the other side
        files = [p for p in files if not p.relative_to(root).parts[0].startswith("hf-")]
    return files


def pack(name: str, parts_dir: str | Path, *, part_size: int = MAX_PART, include_converted: bool = False) -> Path:
    """Pack the cached entry ``name`` into ``parts_dir``; returns the manifest path."""
    if not 1 <= part_size <= MAX_PART:
        raise ValueError(f"part_size must be in [1, {MAX_PART}] bytes, got {part_size}")
    root = model_path(name)
    out = Path(parts_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{name}.part*"):
        old.unlink()
    files = _entry_files(root, include_converted)
    manifest = {"format": FORMAT, "name": name, "part_size": part_size, "files": [], "parts": []}
    part_no, part_fill, part_f, part_h = 0, part_size, None, None

    def close_part():
        if part_f is not None:
            part_f.close()
            manifest["parts"].append({"file": Path(part_f.name).name, "size": part_fill,
                                      "sha256": part_h.hexdigest()})

    for path in files:
        fh = hashlib.sha256()
        with open(path, "rb") as src:
            while chunk := src.read(CHUNK):
                fh.update(chunk)
                view = memoryview(chunk)
                while view:
                    if part_fill == part_size:
                        close_part()
                        part_no += 1
                        part_f, part_h, part_fill = open(out / f"{name}.part{part_no:03d}", "wb"), hashlib.sha256(), 0
                    take = view[:part_size - part_fill]
                    part_f.write(take)
                    part_h.update(take)
                    part_fill += len(take)
                    view = view[len(take):]
        manifest["files"].append({"path": path.relative_to(root).as_posix(), "size": path.stat().st_size,
                                  "sha256": fh.hexdigest()})
    close_part()
    mpath = out / f"{name}.manifest.json"
    mpath.write_text(json.dumps(manifest, indent=1) + "\n")
    return mpath


def _read_manifest(path: Path) -> dict:
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if m.get("format") != FORMAT or not {"name", "files", "parts"} <= m.keys():
        raise ValueError(f"{path} is not a {FORMAT} manifest")
    get_entry(m["name"])
    return m


class _PartStream:
    """Reads the concatenated parts, checking each part's size and sha256 when it is finished."""

    def __init__(self, folder: Path, parts: list[dict]):
        self.folder, self.parts, self.i, self.f, self.h, self.n = folder, list(parts), -1, None, None, 0

    def _next(self) -> bool:
        if self.f is not None:
            self.f.close()
            p = self.parts[self.i]
            if self.n != p["size"] or self.h.hexdigest() != p["sha256"]:
                raise ChecksumError(f"part {p['file']} is damaged (size {self.n} vs {p['size']} or sha256 differs)")
        self.i += 1
        if self.i >= len(self.parts):
            self.f = None
            return False
        path = self.folder / self.parts[self.i]["file"]
        if not path.is_file():
            raise FileNotFoundError(f"missing part {path}")
        self.f, self.h, self.n = open(path, "rb"), hashlib.sha256(), 0
        return True

    def read(self, n: int) -> bytes:
        while True:
            if self.f is None and not self._next():
                return b""
            data = self.f.read(n)
            if data:
                self.h.update(data)
                self.n += len(data)
                return data
            if not self._next():
                return b""


def unpack(parts_dir: str | Path, name: str | None = None) -> list[Path]:
    """Verify and join every manifest in ``parts_dir`` (or only ``name``'s) into the cache; returns the entries."""
    folder = Path(parts_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"parts folder {folder} does not exist")
    manifests = sorted(folder.glob(f"{name}.manifest.json" if name else "*.manifest.json"))
    if not manifests:
        raise FileNotFoundError(f"no *.manifest.json in {folder} (made by `tilespec models pack`)")
    done = []
    for mpath in manifests:
        m = _read_manifest(mpath)
        final = model_dir(m["name"])
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{m['name']}-{os.getpid()}-", dir=final.parent))
        try:
            stream = _PartStream(folder, m["parts"])
            for f in m["files"]:
                dst = tmp / f["path"]
                dst.parent.mkdir(parents=True, exist_ok=True)
                left, h = f["size"], hashlib.sha256()
                with open(dst, "wb") as out:
                    while left:
                        data = stream.read(min(CHUNK, left))
                        if not data:
                            raise ChecksumError(f"parts of {m['name']} end before {f['path']} is complete")
                        out.write(data)
                        h.update(data)
                        left -= len(data)
                if h.hexdigest() != f["sha256"]:
                    raise ChecksumError(f"{f['path']}: sha256 differs from the manifest")
            if stream.read(1):
                raise ChecksumError(f"parts of {m['name']} hold more bytes than the manifest lists")
            if not (tmp / "tilespec.json").is_file():
                raise ValueError(f"{mpath}: packed entry has no tilespec.json")
            done.append(publish(tmp, final))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return done


def verify_entry(name: str) -> None:
    """Re-check the joined source file (``model.gguf``) of a GGUF entry against the registry sha256."""
    entry = get_entry(name)
    src = model_path(name) / entry.source_name
    if src.is_file() and sha256_file(src) != entry.sha256:
        raise ChecksumError(f"{src}: sha256 differs from the pinned {entry.sha256}")


__all__ = ["pack", "unpack", "verify_entry", "MAX_PART", "tilespec_home"]
