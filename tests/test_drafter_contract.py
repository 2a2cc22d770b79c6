"""The drafter contract (engine/drafters/base.py): a drafter written against it alone runs through the host-commit
step and the whole-step graphs (their eager twin, the "native" CPU mode) and through continuous batching, and the
engine's step code names no drafter."""
from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.drafters import Drafter, NgramDrafter
from tilespec.engine.drafters.base import DraftRunner, Proposal
from tilespec.verify.types import SamplingParams

from engine_models import layer_skip, tiny_lm

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12]]
VOCAB = 128
GREEDY = SamplingParams(temperature=0.0)


class RepeatLast(DraftRunner):
    """Proposes the last committed token γ times. Its per-row state (the pending token, as [B, 1] float) comes from
    the prefill and from ``observe`` only; it asks the target for one hidden state and checks its shape."""

    observes = True
    features = (1,)

    def __init__(self, mode: str):
        self.mode = mode
        self.calls = Counter()

    def prefill(self, ids, positions, mask, features, short):
        self.calls["prefill"] += 1
        assert features.shape[:2] == positions.shape
        return ids[:, -1:].float()

    def prefill_row(self, row, ids, positions, mask, write, features):     # continuous batching: one row's chunk
        self.calls["prefill_row"] += 1
        assert features.shape[:2] == positions.shape == (1, ids.shape[1] - 1)
        return ids[:, -1:].float()

    def empty_state(self, batch):
        return torch.zeros((batch, 1))

    def propose(self, view, gamma, resolved, greedy, ex):
        self.calls["propose"] += 1
        tokens = view.hidden.long().expand(-1, gamma).contiguous()
        if greedy:
            return Proposal(tokens)
        logits = torch.full((*tokens.shape, VOCAB), float("-inf"), device=tokens.device)
        return Proposal(tokens, logits.scatter(2, tokens[..., None], 0.0))     # q one-hot: exact at any T

    def observe(self, view, features, out_tokens, num_emitted, ex):
        self.calls["observe"] += 1
        assert features.shape[:2] == out_tokens.shape
        return out_tokens.gather(1, (num_emitted - 1)[:, None]).float()


class RepeatLastDrafter(Drafter):
    name = "repeat-last"

    def __init__(self, context: bool = False):
        self.context = NgramDrafter() if context else None
        self.made: list = []

    @property
    def has_context(self) -> bool:
        return self.context is not None

    def start(self, prompts):
        return self.context.start(prompts) if self.context is not None else None

    def runner(self, batch, capacity, *, target, compile):
        self.made.append(RepeatLast(target.mode))
        return self.made[-1]


def _run(dec, graphed=None):
    gen = dec.prefill(PROMPTS, max_new_tokens=10, seed=3)
    if graphed is not None:
        assert (gen.fast is not None) == graphed
    while not gen.finished:
        dec.commit(gen, dec.step(gen))
    return dec.finish(gen)


@pytest.fixture(scope="module")
def target():
    return tiny_lm(0, logit_scale=4.0)


@pytest.mark.parametrize("compile", [False, "native"])
@pytest.mark.parametrize("context", [False, True])
def test_a_contract_only_drafter_gives_target_only_greedy_tokens(target, compile, context):
    reference = SpeculativeDecoder(target, None, compile=compile, sampling=GREEDY).generate(
        PROMPTS, max_new_tokens=10).sequences
    drafter = RepeatLastDrafter(context)
    out = _run(SpeculativeDecoder(target, drafter, gamma=3, compile=compile, sampling=GREEDY),
               graphed=compile == "native")
    assert out.sequences == reference
    calls = drafter.made[-1].calls
    assert calls["prefill"] == 1 and calls["propose"] > 0 and calls["observe"] >= calls["propose"]
    assert out.stats.drafted > 0


@pytest.mark.parametrize("compile", [False, "native"])
@pytest.mark.parametrize("context", [False, True])
def test_continuous_batching_serves_a_contract_only_drafter(target, compile, context):
    """BatchEngine (``tilespec serve``) drives the same drafter through the contract alone: rows prefilled one chunk
    at a time (``prefill_row``), observed every step; target-only greedy tokens."""
    from tilespec.engine.batching import BatchEngine, BatchRequest

    prompts = PROMPTS + [[3], [20, 21, 22, 20, 21, 22]]
    reference = SpeculativeDecoder(target, None, sampling=GREEDY).generate(prompts, max_new_tokens=10).sequences
    drafter = RepeatLastDrafter(context)
    engine = BatchEngine(target, drafter, max_batch=2, gamma=3, max_len=32, compile=compile, prefill_chunk=3)
    reqs = [BatchRequest(prompt=p, max_tokens=10, temperature=0.0) for p in prompts]
    for r in reqs:
        engine.submit(r)
    while engine.has_work:
        engine.step()
    assert [r.tokens for r in reqs] == reference
    calls = drafter.made[-1].calls
    assert calls["prefill_row"] >= 5 and calls["propose"] > 0 and calls["observe"] == engine.counters["steps"]
    assert engine.counters["accepted"] > 0


def test_continuous_batching_names_a_missing_empty_state(target):
    from tilespec.engine.batching import BatchEngine

    class Stateless(RepeatLast):
        empty_state = DraftRunner.empty_state       # the contract's default: no per-row state

    drafter = RepeatLastDrafter()
    drafter.runner = lambda batch, capacity, *, target, compile: Stateless(target.mode)
    with pytest.raises(TypeError, match="empty_state"):
        BatchEngine(target, drafter, max_batch=2, max_len=16)


def test_host_and_graphed_steps_give_the_same_sampled_tokens(target):
    """One step body: the host-commit step (graph_verify=False keeps the native runners off the whole-step graphs)
    and the graphed step draw the same tokens at T=1."""
    outs = []
    for graphed in (False, True):
        dec = SpeculativeDecoder(target, RepeatLastDrafter(), gamma=3, compile="native",
                                 sampling=SamplingParams(temperature=1.0), graph_verify=graphed)
        outs.append(_run(dec, graphed=graphed))
    assert outs[0].sequences == outs[1].sequences
    assert outs[1].stats.drafted > 0


def test_a_draft_model_scores_context_drafts_in_the_graphed_step(target):
    """[model, "ngram"] on the whole-step graphs: the model scores the context drafts it did not propose (graph D),
    so its cache stays complete for the steps it drafts itself: target-only greedy tokens."""
    reference = SpeculativeDecoder(target, None, compile="native", sampling=GREEDY).generate(
        PROMPTS, max_new_tokens=10).sequences
    dec = SpeculativeDecoder(target, [layer_skip(target, 1), "ngram"], gamma=3, compile="native", sampling=GREEDY)
    out = _run(dec, graphed=True)
    assert out.sequences == reference
    assert out.stats.context_steps > 0 and out.stats.draft_calls > 0


def test_the_step_code_names_no_drafter():
    """No drafter-specific branch in the decoder or the steps: they reach drafters only through the contract."""
    engine = Path(__file__).resolve().parents[1] / "src" / "tilespec" / "engine"
    forbidden = {"head", "HeadRunner", "HeadDrafter", "observes_target", "ModelDrafter", "ModelDraftRunner",
                 "ContextDrafter", "NgramDrafter", "SuffixDrafter", "model_runner", "draft_block", "propose_head"}
    for name in ("decoder.py", "step.py", "step_graph.py", "batching.py", "batch_step.py", "execution.py",
                 "generation.py", "slots.py"):
        tree = ast.parse((engine / name).read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and n.value.isidentifier()}
        assert not used & forbidden, f"{name} names {sorted(used & forbidden)}"
