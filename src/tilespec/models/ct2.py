"""Reader and writer for the CTranslate2 ``model.bin`` format (binary version 6).

Layout (all integers little-endian; a *string* is a uint16 byte count that includes a trailing NUL, then the bytes):

* header: uint32 binary version, string spec name (e.g. ``WhisperSpec``), uint32 spec revision, uint32 variable count;
* per variable: string name, uint8 rank, ``rank`` x uint32 dims, uint8 dtype code, uint32 byte count, raw data
  (C order; rank 0 is a scalar);
* aliases: uint32 count, then per alias two strings ``(alias, target variable)``.

Invariants: ``read_ct2(write_ct2(p, v, a))`` returns exactly ``v`` and ``a``; every array keeps its dtype and shape.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SUPPORTED_VERSION = 6
# CTranslate2 dtype codes -> numpy dtypes (5 = bfloat16 has no numpy dtype and is rejected).
DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
}
CODES = {dt: code for code, dt in DTYPES.items()}


@dataclass
class CT2Model:
    """Contents of a ``model.bin``: ``variables`` name -> ndarray, ``aliases`` alias -> variable name."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str] = field(default_factory=dict)
    version: int = SUPPORTED_VERSION

    def get(self, name: str) -> np.ndarray:
        """The array called ``name``, following an alias if needed (KeyError if absent)."""
        return self.variables[self.aliases.get(name, name)]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated CTranslate2 file (needed {n} bytes at offset {self.pos}, "
                             f"file has {len(self.buf)})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def uint(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.uint("H")
        raw = bytes(self.take(n))
        return raw[:-1].decode("utf-8") if raw.endswith(b"\0") else raw.decode("utf-8")


def read_ct2(path: str | Path) -> CT2Model:
    """Parse a CTranslate2 ``model.bin``; raises FileNotFoundError / ValueError on a missing or malformed file."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    if not path.is_file():
        raise FileNotFoundError(f"no CTranslate2 model file at {path}")
    buf = memoryview(path.read_bytes())
    cur = _Cursor(buf, path)
    version = cur.uint("I")
    if version != SUPPORTED_VERSION:
        raise ValueError(f"{path}: CTranslate2 binary version {version} is not supported (only {SUPPORTED_VERSION})")
    spec = cur.string()
    revision = cur.uint("I")
    count = cur.uint("I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(count):
        name = cur.string()
        rank = cur.uint("B")
        dims = tuple(cur.uint("I") for _ in range(rank))
        code = cur.uint("B")
        nbytes = cur.uint("I")
        if code not in DTYPES:
            raise ValueError(f"{path}: variable {name!r} has unsupported dtype code {code} (5 = bfloat16 unsupported)")
        dtype = DTYPES[code]
        expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
        if nbytes != expected:
            raise ValueError(f"{path}: variable {name!r} has {nbytes} bytes, shape {dims} needs {expected}")
        data = np.frombuffer(cur.take(nbytes), dtype=dtype).reshape(dims)
        variables[name] = data
    aliases: dict[str, str] = {}
    if cur.pos < len(buf):
        for _ in range(cur.uint("I")):
            alias = cur.string()
            aliases[alias] = cur.string()
    return CT2Model(spec=spec, revision=revision, variables=variables, aliases=aliases, version=version)


def _pack_string(s: str) -> bytes:
    raw = s.encode("utf-8") + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_ct2(path: str | Path, spec: str, revision: int, variables: dict[str, np.ndarray],
              aliases: dict[str, str] | None = None) -> Path:
    """Write ``variables`` (numpy arrays of a supported dtype) as a version-6 ``model.bin`` at ``path``."""
    path = Path(path)
    with open(path, "wb") as f:
        f.write(struct.pack("<I", SUPPORTED_VERSION) + _pack_string(spec) + struct.pack("<II", revision, len(variables)))
        for name, arr in variables.items():
            arr = np.array(arr, order="C")  # not ascontiguousarray: it turns rank 0 into rank 1
            dtype = arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1 else arr.dtype
            if dtype not in CODES:
                raise ValueError(f"variable {name!r}: dtype {arr.dtype} cannot be written to CTranslate2 format")
            f.write(_pack_string(name) + struct.pack("<B", arr.ndim))
            f.write(struct.pack(f"<{arr.ndim}I", *arr.shape))
            data = arr.astype(dtype, copy=False).tobytes()
            f.write(struct.pack("<BI", CODES[dtype], len(data)) + data)
        aliases = aliases or {}
        f.write(struct.pack("<I", len(aliases)))
        for alias, target in aliases.items():
            f.write(_pack_string(alias) + _pack_string(target))
    return path
