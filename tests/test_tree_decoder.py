"""Tree verification in the one decode loop (engine/step.py's verify_phase with tree proposals, engine/tree_step.py,
drafters/head_tree.py, context_tree.py, model_tree.py; SpeculativeDecoder(tree=... | chains=...), TreeDecoder its
subclass) on tiny random models: the tree mask / positions / compaction, oracle trees whose accepted path sits at
scattered node indices (token-identical to target-only greedy decoding, batched and ragged), the head's dynamic trees
and sampled chains, context trees and a draft model's chains (token-identical at T = 0 on the eager and native
runtimes, with finished rows dropped or kept), the whole-step graph path, and the sequence law at T > 0."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.drafters import HeadDrafter
from tilespec.engine.native.runner import NativeRunner
from tilespec.engine.state import BatchState, left_pad, prefill_mask
from tilespec.engine.tree_decoder import TreeDecoder
from tilespec.engine.drafters.contract import Proposal
from tilespec.engine.execution import HostExecution
from tilespec.engine.step import run_verify, verify_phase
from tilespec.engine.tree_step import compact, tree_mask, tree_positions
from tilespec.exactness.stats import fit_test
from tilespec.heads import DraftHead, config_for
from tilespec.multidraft.tree import TokenTree, ancestors
from tilespec.verify import SamplingParams

from engine_models import exact_sequence_law, tiny_lm

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(temperature=0.0)
VOCAB = 32


def test_tree_mask_and_positions():
    parents = torch.tensor([[-1, 0, 0, 1, -1]])
    anc = ancestors(parents)
    valid = torch.zeros(1, 12, dtype=torch.bool)
    valid[0, [1, 2, 4]] = True                                   # committed context with a hole at 3
    mask = tree_mask(valid, torch.tensor(5), anc)[0, 0]
    seen = [mask[n].nonzero().squeeze(1).tolist() for n in range(5)]
    assert seen == [[1, 2, 4, 5], [1, 2, 4, 5, 6], [1, 2, 4, 5, 7], [1, 2, 4, 5, 6, 8], [1, 2, 4, 9]]
    assert tree_positions(torch.tensor([4]), anc).tolist() == [[3, 4, 4, 5, 3]]


def test_compact_moves_the_path_to_consecutive_slots():
    buf = torch.arange(2 * 1 * 12 * 1, dtype=torch.float32).view(2, 1, 12, 1).clone()
    before = buf.clone()
    path = torch.tensor([[0, 3, 5, -1], [0, -1, -1, -1]])
    compact([buf], torch.tensor(4), path)
    assert buf[0, 0, 4:8, 0].tolist() == [before[0, 0, 4, 0], before[0, 0, 7, 0], before[0, 0, 9, 0],
                                          before[0, 0, 7, 0]]
    assert torch.equal(buf[1], before[1]) and torch.equal(buf[0, :, :4], before[0, :, :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_compaction_equals_a_gather_per_buffer(dtype):
    """native/slot_moves.py in Triton's interpreter: every buffer (views of the first rows too, as continuous
    batching passes them) gets the gather-per-buffer result, for paths that jump ahead, padding and a root-only row."""
    from tilespec.engine.native import slot_moves
    from tilespec.engine.tree_step import compact_slots, move_slots
    if not slot_moves.triton_interpreted() and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    full = [torch.randn(4, 2, 40, 16, dtype=dtype, device=dev) for _ in range(6)]
    bufs = [t[:3] for t in full]                                  # first-rows views
    want = [t.clone() for t in bufs]
    spare = [t[3].clone() for t in full]
    path = torch.tensor([[0, 2, 5, 9], [0, 1, 3, -1], [0, -1, -1, -1]], device=dev)
    dst, src = compact_slots(torch.tensor(20, device=dev), path)
    assert slot_moves.supported(bufs)
    slot_moves.move_path_slots(bufs, dst, src)
    move_slots(want, dst, src)
    assert all(torch.equal(a, b) for a, b in zip(bufs, want))
    assert all(torch.equal(t[3], u) for t, u in zip(full, spare))                 # the row past the view untouched
    assert not slot_moves.supported([full[0], full[1][:, :1]])                          # mixed shapes
    with pytest.raises(ValueError, match="one shape"):
        slot_moves.move_path_slots([full[0], full[1][:, :1]], dst, src)
    with pytest.raises(ValueError, match="src"):
        slot_moves.move_path_slots(bufs, dst, src[:2])


def _oracle_tree(correct: list, shape: int, pending: int) -> tuple[list, list]:
    """Parents and tokens of an 8-node tree holding the correct continuation at scattered indices."""
    c = correct + [0, 0, 0]
    w = [(t + 1) % VOCAB for t in c]
    if shape == 0:   # correct path 0 -> 3 -> 5 -> 6
        return [-1, 0, 0, 0, 3, 3, 5, 1], [pending, w[0], (c[0] + 2) % VOCAB, c[0], w[1], c[1], c[2], c[1]]
    # correct path only one deep (node 2), a wrong deep branch
    return [-1, 0, 0, 1, 3, 2, -1, -1], [pending, w[0], c[0], c[1], c[2], w[1], 0, 0]


@pytest.mark.parametrize("compile,one_launch", [(False, False), ("native", False), ("native", True)])
@torch.inference_mode()
def test_oracle_trees_are_token_identical_to_target_only(compile, one_launch, monkeypatch):
    if one_launch:      # the CUDA compaction kernel (native/slot_moves.py), here in Triton's interpreter
        from tilespec.engine import tree_step
        from tilespec.engine.native import slot_moves
        monkeypatch.setattr(tree_step, "one_launch", slot_moves.supported)
    target = tiny_lm(3, vocab=VOCAB, logit_scale=4.0)
    prompts = [[3, 9, 4, 1, 7], [5, 2]]
    new = 18
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile=compile).generate(prompts, max_new_tokens=new)
    runner = NativeRunner(target, 128, mode="native") if compile else None
    if runner is None:
        from tilespec.engine.runner import ModelRunner
        runner = ModelRunner(target, 128)
    ids, is_tok = left_pad(prompts, 0, "cpu")
    p = ids.shape[1] - 1
    positions = (is_tok[:, :p].long().cumsum(1) - 1).clamp(min=0)
    runner.forward(ids[:, :p], positions, prefill_mask(is_tok[:, :p], 128), 0, keep=1)
    state = BatchState.prefilled(ids, is_tok, 128, [0, 1], new, [])
    out = [[], []]
    counts = []
    while min(len(o) for o in out) < new:
        trees = [_oracle_tree(ref.sequences[b][len(out[b]):], b, int(state.pending[b])) for b in range(2)]
        tree = TokenTree(parents=torch.tensor([t[0] for t in trees]), tokens=torch.tensor([t[1] for t in trees]),
                         sizes=torch.tensor([8, 6]))
        ex = HostExecution(run_verify, graphs=False)      # the step body's verify phase, as the decoder runs it
        num_emitted, tokens, _, path = verify_phase(runner, None, state, Proposal.of_tree(tree), GREEDY,
                                                    "reference", True, ex)
        emitted = num_emitted.tolist()
        for b in range(2):
            out[b] += tokens[b, :emitted[b]].tolist()
        state.commit(num_emitted, tokens, path, max(emitted) - 1)
        counts.append(emitted)
    assert [o[:new] for o in out] == ref.sequences
    assert counts[:4] == [[4, 2]] * 4     # 3 drafts + 1 / 1 draft + 1 while the reference lasts: the path is kept


def _random_head(target, vocab_ids=None, noise=0.0):
    cfg = config_for(target) if vocab_ids is None else config_for(target, draft_vocab=len(vocab_ids))
    head = DraftHead(cfg, vocab_ids=vocab_ids).init_from(target)
    if noise:
        torch.manual_seed(1)
        with torch.no_grad():
            for prm in head.parameters():
                prm.add_(noise * torch.randn_like(prm))
    return head.bind(target).eval().requires_grad_(False)


@pytest.mark.parametrize("compile", [False, "native"])
def test_head_trees_greedy_equal_target_only(compile):
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2, logit_scale=4.0)
    head = _random_head(target)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (6, 3, 9)]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile=compile).generate(prompts, max_new_tokens=20)
    for shape in ({"tree": (4, 3, 12)}, {"tree": (2, 2, 3)}, {"chains": (2, 3)}):
        dec = TreeDecoder(target, HeadDrafter(head), sampling=GREEDY, compile=compile, eos_token_id=[],
                          run_ahead=True, **shape)
        out = dec.generate(prompts, max_new_tokens=20)
        assert out.sequences == ref.sequences, shape
        # dynamic trees and sampled chains (specinfer: a selection without host syncs) on native runners: every
        # step in the whole-step graphs, launched ahead of the host read where the chain would be
        graphed = compile == "native"
        assert out.stats.graphed_steps == (out.stats.steps if graphed else 0), shape
        assert (out.stats.ahead_steps > 0) == graphed, shape
    assert dec.last_stats.steps > 0
    # the importance-sampling scheme solves LPs on the host: its chains stay host-commit steps
    dec = TreeDecoder(target, HeadDrafter(head), sampling=GREEDY, compile=compile, eos_token_id=[], chains=(2, 3),
                      scheme="is")
    out = dec.generate(prompts, max_new_tokens=20)
    assert out.sequences == ref.sequences and out.stats.graphed_steps == 0


@pytest.mark.parametrize("compile", [False, "native"])
def test_eos_ends_a_request_early(compile):
    """EOS ends one request early: the eager path drops its row from every runner (the head's cache, the context
    tree's histories, the draft model's resync chunk), the native path keeps it ignored."""
    from engine_models import layer_skip
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2, logit_scale=4.0)
    head = _random_head(target)
    prompts = [[4, 7, 1, 4, 7, 1, 4], [9, 9, 2, 5], [3, 3]]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile=compile).generate(prompts, max_new_tokens=16)
    eos = ref.sequences[1][5]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile=compile,
                             eos_token_id=eos).generate(prompts, max_new_tokens=16)
    assert min(map(len, ref.sequences)) < 16 <= max(map(len, ref.sequences))
    for draft, shape in ((HeadDrafter(head), {"tree": (3, 3, 8)}), ("ngram", {"tree": (3, 3, 8)}),
                         (layer_skip(target, 1), {"chains": (2, 3)})):
        out = SpeculativeDecoder(target, draft, sampling=GREEDY, compile=compile, eos_token_id=eos,
                                 **shape).generate(prompts, max_new_tokens=16)
        assert out.sequences == ref.sequences, (draft, shape)


LAW_VOCAB, LENGTH, N = 6, 3, 3000
LAW_PROMPT = [1, 4, 2, 1, 4, 3, 5, 1, 4]


@pytest.mark.parametrize("shape,sampling", [
    ({"tree": (2, 3, 6)}, SamplingParams(temperature=1.0, top_k=4)),
    ({"chains": (2, 2), "scheme": "spectr"}, SamplingParams(temperature=1.0)),
    ({"chains": (2, 2), "scheme": "specinfer", "draft_sampling": SamplingParams(temperature=1.5)},
     SamplingParams(temperature=1.0)),     # a draft model (its cache resynced every step), hotter drafts
])
def test_tree_decoded_sequences_follow_the_target_law(shape, sampling):
    from engine_models import layer_skip
    target = tiny_lm(10, vocab=LAW_VOCAB, logit_scale=6.0)
    draft = HeadDrafter(_random_head(target, vocab_ids=torch.tensor([0, 2, 3, 5]), noise=0.3))
    if "draft_sampling" in shape:
        draft = layer_skip(target, 1)
    dec = TreeDecoder(target, draft, sampling=sampling, eos_token_id=[], compile="native", **shape)
    out = dec.generate([LAW_PROMPT] * N, max_new_tokens=LENGTH, seed=2024)
    assert 1.05 < dec.last_stats.block_efficiency < LENGTH           # accepts and rejects
    index = [int(np.ravel_multi_index(q, [LAW_VOCAB] * LENGTH)) for q in out.sequences]
    law = exact_sequence_law(target, sampling, LAW_PROMPT, LAW_VOCAB, LENGTH)
    result = fit_test(np.bincount(index, minlength=LAW_VOCAB ** LENGTH), law)
    assert result.impossible == 0
    assert result.p_value > 1e-6, result


def test_bad_settings_are_refused():
    target = tiny_lm(0, vocab=VOCAB)
    head = _random_head(target)
    with pytest.raises(ValueError, match="nodes"):
        TreeDecoder(target, HeadDrafter(head), tree=(4, 3, 80))
    with pytest.raises(ValueError, match="candidates"):
        TreeDecoder(target, HeadDrafter(head), tree=(2, 2, 20))
    with pytest.raises(ValueError, match="chains"):
        TreeDecoder(target, tiny_lm(1, vocab=VOCAB))             # a draft model proposes sampled chains
    with pytest.raises(ValueError, match="vocabulary"):
        TreeDecoder(target, tiny_lm(1, vocab=VOCAB + 1), chains=(2, 2))
    with pytest.raises(ValueError, match="head"):
        TreeDecoder(target, [tiny_lm(1, vocab=VOCAB), "ngram"])
    with pytest.raises(ValueError, match="chains"):
        TreeDecoder(target, "ngram", chains=(2, 2))
    with pytest.raises(ValueError, match="scheme"):
        TreeDecoder(target, HeadDrafter(head), chains=(2, 2), scheme="nope")
    with pytest.raises(ValueError, match="compile"):
        TreeDecoder(target, HeadDrafter(head), compile="graphs")
    with pytest.raises(ValueError, match="lenience"):
        TreeDecoder(target, HeadDrafter(head), sampling=SamplingParams(lenience=0.5))
    with pytest.raises(ValueError, match="constant"):
        SpeculativeDecoder(target, HeadDrafter(head), tree=(2, 2, 3), gamma_schedule="heuristic")
    with pytest.raises(ValueError, match="one of"):
        SpeculativeDecoder(target, HeadDrafter(head), tree=(2, 2, 3), chains=(2, 2))
    with pytest.raises(ValueError, match="drafter"):
        SpeculativeDecoder(target, None, tree=(2, 2, 3))


def test_generate_cli_tree_matches_target_only(monkeypatch, tmp_path):
    import json

    import tilespec.cli.generate as gen
    from tilespec.cli import main
    from test_engine_cli import ToyTokenizer

    target = tiny_lm(0, logit_scale=20.0)
    target.generation_config.eos_token_id = None
    head = HeadDrafter(_random_head(target))
    monkeypatch.setattr(gen, "load_pair", lambda t, d, device, dtype, log=None: (target, head if d == "head" else d,
                                                                              ToyTokenizer()))
    outs = {}
    for name, extra in (("ar", []), ("tree", ["--draft", "head", "--tree", "8", "--tree-branch", "3",
                                              "--tree-depth", "3"]),
                        ("chains", ["--draft", "head", "--chains", "2,3", "--scheme", "spectr"]),
                        ("context", ["--draft", "ngram", "--tree", "8", "--tree-branch", "3", "--tree-depth", "3"])):
        path = tmp_path / f"{name}.json"
        assert main(["generate", "--target", "t", "--prompt", "hello", "--max-new-tokens", "10", "--json", str(path),
                     "--device", "cpu", *extra]) == 0
        outs[name] = json.loads(path.read_text())["tokens"]
    assert outs["tree"] == outs["ar"] == outs["chains"] == outs["context"]


class _TwiceGraphs:
    """A CPU stand-in for GraphCache: static input copies, the function run twice (warm-up, then the replay), the
    second output returned -- what a capture does to a step, so the step must be repeatable on the same inputs."""

    calls = 0

    def __init__(self, fn, max_graphs=256):
        self.fn = fn

    def __call__(self, *args, key=None):
        static = tuple(a.clone() for a in args)
        self.fn(*static, key=key)
        _TwiceGraphs.calls += 1
        return self.fn(*static, key=key)

    def __len__(self) -> int:
        return 0

    def clear(self) -> None:
        pass


def test_captured_step_path_repeats_safely(monkeypatch):
    """The whole-step graphs run a dynamic-tree or sampled-chains step (graph D: the head's tree; graph T: tree
    forward, selection, compaction, observe, commit) repeatably (warm-up run + replay on the same inputs): target-only's tokens at T = 0,
    and at T = 1 the host-commit path's tokens (graph_verify=False keeps the native runners off the graphs)."""
    import tilespec.engine.step_graph as sg
    monkeypatch.setattr(sg, "_Direct", _TwiceGraphs)
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2, logit_scale=4.0)
    head = _random_head(target)
    prompts = [[3, 8, 1, 9], [2, 2, 7]]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile="native").generate(prompts, max_new_tokens=16)
    _TwiceGraphs.calls = 0
    dec = TreeDecoder(target, HeadDrafter(head), tree=(4, 3, 10), sampling=GREEDY, compile="native",
                      eos_token_id=[])
    out = dec.generate(prompts, max_new_tokens=16)
    assert out.sequences == ref.sequences and _TwiceGraphs.calls > out.stats.steps
    t1 = SamplingParams(temperature=1.0, top_p=0.9)     # keyed randomness: the same tokens on both paths
    for shape in ({"tree": (4, 3, 10)}, {"chains": (3, 3)}):    # chains: the sync-free specinfer selection
        runs = []
        for graphed in (False, True):
            _TwiceGraphs.calls = 0
            dec = TreeDecoder(target, HeadDrafter(head), sampling=t1, compile="native", eos_token_id=[],
                              graph_verify=graphed, **shape)
            runs.append(dec.generate(prompts, max_new_tokens=16, seed=7).sequences)
            assert (_TwiceGraphs.calls > 0) == graphed
        assert runs[0] == runs[1], shape


def test_context_trees_greedy_equal_target_only():
    from tilespec.engine.drafters.context_tree import continuations, trie
    assert continuations([1, 2, 3, 1, 2, 4, 1, 2], 3, 2) == [[4, 1], [3, 1]]
    assert continuations([7, 2, 5, 1, 2, 4, 1, 2], 3, 2) == [[4, 1], [5, 1]]   # [5, 1]: from the 1-gram [2]
    assert trie(2, [[4, 1], [3, 1], [4, 5]], 8) == ([-1, 0, 1, 0, 3, 1], [2, 4, 1, 3, 1, 5])
    target = tiny_lm(3, vocab=VOCAB, logit_scale=4.0)
    prompts = [[3, 9, 4, 3, 9, 5, 3, 9, 4, 3], [5, 2, 5, 2, 5, 2]]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile="native").generate(prompts, max_new_tokens=24)
    dec = TreeDecoder(target, "ngram", tree=(4, 4, 12), sampling=GREEDY, compile="native", eos_token_id=[])
    out = dec.generate(prompts, max_new_tokens=24)
    assert out.sequences == ref.sequences
    assert out.stats.block_efficiency > 1.0


def test_defragmenting_mid_generation_keeps_tokens():
    """No slack for the holes of ragged acceptance (context trees accept much more on the looping rows): the caches
    are defragmented mid-generation (the eager runtime: compiled ones round the capacity up to 256 slots)."""
    target = tiny_lm(3, vocab=VOCAB, logit_scale=4.0)
    prompts = [[3, 9, 4, 3, 9, 5, 3, 9, 4, 3], [5, 2, 7, 1], [8]]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile="native").generate(prompts, max_new_tokens=40)
    dec = TreeDecoder(target, "ngram", tree=(4, 4, 12), sampling=GREEDY, compile=False, eos_token_id=[],
                      cache_slack=0)
    out = dec.generate(prompts, max_new_tokens=40)
    assert out.sequences == ref.sequences and out.stats.defrags > 0
    head = _random_head(target)
    dec = TreeDecoder(target, HeadDrafter(head), tree=(3, 3, 8), sampling=GREEDY, compile=False,
                      eos_token_id=[], cache_slack=0)
    assert dec.generate(prompts, max_new_tokens=40).sequences == ref.sequences and dec.last_stats.defrags > 0


@pytest.mark.parametrize("scheme,slack", [("specinfer", None), ("is", 0)])
def test_draft_model_chains_greedy_equal_target_only(scheme, slack):
    from engine_models import layer_skip
    target = tiny_lm(3, vocab=VOCAB, logit_scale=4.0)
    draft = layer_skip(target, 1)
    prompts = [[3, 9, 4, 3, 9, 5, 3, 9, 4, 3], [5, 2, 7, 1], [8]]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile="native").generate(prompts, max_new_tokens=30)
    dec = TreeDecoder(target, draft, chains=(2, 3), scheme=scheme, sampling=GREEDY,
                      compile="native" if slack is None else False, eos_token_id=[], cache_slack=slack)
    out = dec.generate(prompts, max_new_tokens=30)
    assert out.sequences == ref.sequences and out.stats.block_efficiency > 1.3
    assert slack is None or out.stats.defrags > 0


def _prefilled_head():
    """A noisy random head over a 2-layer Qwen2-shaped target, two prompts prefilled into a native runner and the
    head's runner -> (head, its HeadRunner, the batch state, the head's output at the last prompt entries)."""
    from tilespec.engine.drafters.head import HeadRunner
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2, logit_scale=4.0)
    head = _random_head(target, noise=0.2)
    ids, is_tok = left_pad([[3, 9, 4, 1, 7], [5, 2]], 0, "cpu")
    p, cap = ids.shape[1] - 1, 64
    positions = (is_tok[:, :p].long().cumsum(1) - 1).clamp(min=0)
    pmask = prefill_mask(is_tok[:, :p], cap)
    runner, hr = NativeRunner(target, cap, mode="native"), HeadRunner(head, 2, cap, "eager")
    _, feats = runner.forward(ids[:, :p], positions, pmask, 0, keep=1, capture=hr.features)
    state = BatchState.prefilled(ids, is_tok, cap, [0, 1], 8, [])
    return head, hr, state, hr.prefill(ids, positions, pmask, feats, False)


@torch.inference_mode()
def test_head_tree_is_a_valid_tree_of_the_best_candidates():
    from tilespec.engine.drafters.head_tree import propose_tree
    from tilespec.multidraft.tree import depths
    head, hr, state, hidden = _prefilled_head()
    tree = propose_tree(hr, hidden, state.pending, state.valid, state.seq_len, torch.tensor(state.write), 3, 4, 12)
    tree.validate(VOCAB)                                         # parents earlier, tokens in range, no padding
    assert tree.tokens[:, 0].tolist() == state.pending.tolist()
    assert int(depths(tree.parents).max()) <= 4
    # the root's children are the head's top tokens: the best-scoring candidates always stay in the tree
    top = head.vocab_ids[torch.log_softmax(head.logits(hidden).float(), -1).topk(3).indices]
    for b in range(2):
        kids = tree.tokens[b][(tree.parents[b] == 0)].tolist()
        assert top[b, 0].item() in kids


@torch.inference_mode()
def test_the_compiled_tree_regions_trace_whole_and_draw_the_same_numbers(monkeypatch):
    """What a captured tree step on CUDA compiles (engine/fused.py: the head's frontier bookkeeping, the tree's
    inputs, the selection with its path) traces as one graph per region (fullgraph) and gives the plain functions'
    trees, masks, draws and paths bit for bit. Backend aot_eager: dynamo's trace and functionalization without
    inductor's C++ codegen, whose -O3 build breaks Philox's wrapping int64 products (signed overflow is undefined in
    C++; CUDA compiles to Triton, where they wrap)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    import tilespec.engine.fused as fused
    from tilespec.engine.drafters.head_tree import propose_tree
    from tilespec.engine.tree_step import tree_inputs, tree_path
    from tilespec.multidraft.common import uniform_tables
    from tilespec.verify.validation import resolve_sampling
    counter, made = CompileCounterWithBackend("aot_eager"), {}
    monkeypatch.setattr(fused, "compiled", lambda fn: made.setdefault(
        fn, torch.compile(fn, backend=counter, fullgraph=True, dynamic=False)))
    head, hr, state, hidden = _prefilled_head()
    view = (hidden, state.pending, state.valid, state.seq_len, torch.tensor(state.write), 3, 4, 12)
    tree = propose_tree(hr, *view)
    same = propose_tree(hr, *view, compiled=True)
    assert all(torch.equal(getattr(tree, f), getattr(same, f)) for f in ("parents", "tokens", "sizes"))
    args = (tree.parents, tree.tokens, state.valid, torch.tensor(state.write), state.seq_len)
    assert all(torch.equal(a, b) for a, b in zip(tree_inputs(*args), fused.fused(tree_inputs, True)(*args)))
    # target laws under which the drafted children are likely: paths get accepted, the rejection walk is exercised
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 12, VOCAB, generator=g).index_put_(
        (torch.arange(2)[:, None], tree.parents.clamp(min=0), tree.tokens), 5.0 * (tree.parents >= 0).float(),
        accumulate=True)
    resolved = resolve_sampling(SamplingParams(temperature=1.0), 2, "cpu")
    emitted = 0
    for seed in range(6):
        sel = (tree, logits, torch.randn(2, 12, 5, generator=g), resolved, torch.tensor([seed, 40 + seed]),
               state.seq_len, torch.tensor(state.write), None, "specinfer", "gumbel", 4, None)
        plain, comp = tree_path(*sel, uniforms=uniform_tables), fused.fused(tree_path, True)(*sel,
                                                                                           uniforms=uniform_tables)
        assert all(torch.equal(a, b) for a, b in zip([*plain[:5], *plain[5]], [*comp[:5], *comp[5]]))
        emitted += int(plain[0].sum())
    assert emitted > 2 * 6 + 4                   # drafts were accepted
    assert counter.frame_count == 5             # root, level, finish, inputs, path: one graph each, no recompile


def test_a_failing_whole_step_graph_hands_over_to_the_host_commit_step(monkeypatch):
    """Where the whole-step graphs fail (on CUDA: a step shape that cannot be captured) the generation goes on with
    host-commit steps and the same tokens (the failed step changed no state)."""
    import tilespec.engine.generation as generation
    from tilespec.engine.step_graph import StepGraphs
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2, logit_scale=4.0)
    head = _random_head(target)
    prompts = [[3, 8, 1, 9], [2, 2, 7]]
    ref = SpeculativeDecoder(target, None, sampling=GREEDY, compile="native").generate(prompts, max_new_tokens=12)
    step, calls = StepGraphs.step, []

    def fail_third(self, *args, **kwargs):
        calls.append(1)
        if len(calls) != 3:
            return step(self, *args, **kwargs)
        graphs = self._target_graphs

        def capture_fails(*inputs, key=None):
            self._target_block(*inputs, key=key)    # the warm-up ran (K/V and head entries written past W) ...
            raise RuntimeError("operation not permitted when stream is capturing")    # ... then the capture failed

        self._target_graphs = capture_fails
        try:
            return step(self, *args, **kwargs)
        finally:
            self._target_graphs = graphs

    monkeypatch.setattr(StepGraphs, "step", fail_third)
    monkeypatch.setattr(generation, "FALLBACK_DEVICES", ("cpu", "cuda"))
    dec = SpeculativeDecoder(target, HeadDrafter(head), tree=(3, 3, 8), sampling=GREEDY, compile="native",
                             eos_token_id=[], run_ahead=False)
    with pytest.warns(UserWarning, match="host-commit"):
        out = dec.generate(prompts, max_new_tokens=12)
    assert out.sequences == ref.sequences and out.stats.graphed_steps == 2 < out.stats.steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_p=0.9)])
def test_head_chains_and_trees_run_in_cuda_step_graphs(sampling):
    """On CUDA ("native-graphs") a head's dynamic trees and its sampled chains (specinfer) run every step in the
    whole-step graphs (their helpers' own graphs stay out of the enclosing capture) and give the host path's tokens."""
    target = tiny_lm(0, "qwen2", vocab=VOCAB, layers=2, logit_scale=4.0).cuda()
    head = _random_head(target).cuda()          # its embedding / LM head rows are the (CUDA) target's already
    prompts = [[3, 8, 1, 9], [2, 2, 7]]
    for shape in ({"tree": (4, 3, 10)}, {"chains": (3, 3)}):
        runs = []
        for graphed in (True, False):
            dec = TreeDecoder(target, HeadDrafter(head), sampling=sampling, compile=True, eos_token_id=[],
                              graph_verify=graphed, **shape)
            out = dec.generate(prompts, max_new_tokens=16, seed=7)
            runs.append(out.sequences)
            if graphed:
                assert out.stats.graphed_steps == out.stats.steps, shape
        assert runs[0] == runs[1], shape
