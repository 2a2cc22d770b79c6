"""The speech inputs of ``tilespec bench e2e --whisper``: which ASR sets a run uses, their decoder prompts and log-mel
features, and the Whisper defaults of --target / --draft."""
from __future__ import annotations

ASR_TASKS = ("ljspeech", "synthetic")


def asr_tasks(args) -> list:
    """The ASR prompt sources of a --whisper run: --task's ljspeech / synthetic (the text default: ljspeech)."""
    tasks = [t for t in str(args.task).split(",") if t in ASR_TASKS]
    return tasks or ["ljspeech"]


def whisper_inputs(args, target, proc, device, dtype, task: str = "ljspeech"):
    """(decoder prompts [N], input_features [N, mels, frames]): ljspeech -> the first N clips of --audio-dir (sorted;
    LJ001-0001.. are the evaluation clips, tilespec.datasets.ljspeech_split), synthetic -> N clips of the synthetic
    set (--synthetic-dir / $TILESPEC_SYNTH_DIR), subsampled with seed 0."""
    from tilespec.env import data_root
    from tilespec.models.whisper import decoder_prompt, features, load_audio
    if task == "synthetic":
        from tilespec.datasets import load_synthetic
        audios = [r["audio"] for r in load_synthetic(args.num_prompts, 0, folder=args.synthetic_dir)]
    else:
        folder = args.audio_dir or data_root() / "ljspeech" / "wavs"
        clips = sorted(p for p in folder.iterdir() if p.suffix in (".flac", ".wav"))[:args.num_prompts] \
            if folder.is_dir() else []
        if not clips:
            raise FileNotFoundError(f"no .flac/.wav clips in {folder} (pass --audio-dir or set TILESPEC_DATA)")
        audios = [load_audio(c) for c in clips]
    prefix = decoder_prompt(target, proc)
    return [list(prefix) for _ in audios], features(proc, audios, device, dtype)


def whisper_defaults(args) -> None:
    """--whisper: replace the text defaults of --target / --draft (keep what the user chose); idempotent."""
    if args.whisper:
        if args.target == "qwen2.5-coder-1.5b-instruct":
            args.target = "whisper-base"
        if args.draft == "qwen2.5-coder-0.5b-instruct":
            args.draft = f"{args.target}:layers=2"
