"""``TreeDecoder``: exact speculative decoding that verifies a token tree per step, on the native runtime.

Per step (B requests; state.py's slot layout): a draft head proposes a tree per request -- an EAGLE-2-style dynamic
tree of ``nodes`` nodes (``tree=(branch, depth, nodes)``, deterministic drafts, any temperature) or K sampled chains
(``chains=(K, L)``, the seed-004 multi-draft schemes: specinfer / spectr / is), or the context proposes several
n-gram matches as branches (``draft="ngram"``, drafters/context_tree.py) -- ONE target forward scores every
node (tree mask, positions = depth; engine/tree_step.py), ``select_tree`` picks the accepted path exactly
(multidraft/tree.py), the path's K/V are compacted to the next slots, and the head observes the path's features.
One host read per step. On "native-graphs" (CUDA) a dynamic-tree step runs as ONE CUDA graph per (B, tree shape,
capacity) -- head tree, target forward, selection, compaction, observe; chain trees capture the target forward.

Decoding is exact: with ``sampling`` at temperature 0 the output equals target-only greedy decoding token for token
(tests/test_tree_decoder.py); at T > 0 the emitted sequences have the target's law.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from tilespec.multidraft.schemes import parse_scheme
from tilespec.verify.types import SamplingParams
from tilespec.verify.validation import resolve_sampling

from .drafters import resolve_drafter
from .drafters.head import HeadDrafter
from .drafters.base import ContextDrafter, ModelDrafter
from .drafters.context_tree import context_trees
from .drafters.head_tree import propose_chains, propose_tree, tree_candidates
from .drafters.model_tree import Resync, propose_model_chains, resync_law
from .generation import eos_ids
from .graphs import GraphCache
from .inputs import check_request
from .leases import shared_runner
from .prompts import prompt_lists
from .state import BatchState, left_pad, prefill_mask
from .tree_step import TreeStepOutput, finish_step, score_tree

TREE_MODES = ("eager", "native", "native-graphs")


@dataclass
class TreeStats:
    """Counters of one generation: steps (= target forwards), new tokens, per-step accepted draft tokens."""

    requests: int = 0
    steps: int = 0
    new_tokens: int = 0
    accepted: list = field(default_factory=list)     # per step and live request: draft tokens accepted
    nodes: int = 0
    wall_time: float = 0.0
    graphed: bool = False
    defrags: int = 0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per target forward and request (block efficiency tau)."""
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def accepted_histogram(self) -> list:
        """[n_0, n_1, ...]: request-steps that accepted 0, 1, ... draft tokens (the tree's depth profile)."""
        hist = [0] * (max(self.accepted, default=0) + 1)
        for a in self.accepted:
            hist[a] += 1
        return hist

    def to_dict(self) -> dict:
        return {"requests": self.requests, "steps": self.steps, "new_tokens": self.new_tokens,
                "accepted_histogram": self.accepted_histogram(),
                "tokens_per_step": self.tokens_per_step, "tokens_per_second": self.tokens_per_second,
                "wall_time": self.wall_time, "nodes": self.nodes, "graphed": self.graphed, "defrags": self.defrags}


@dataclass
class TreeOutput:
    sequences: list
    stats: TreeStats
    texts: Optional[list] = None


class TreeDecoder:
    """Tree-verified speculative decoding of ``target`` with a draft head (see the module docstring).

    Args:
        target: a Llama-family transformers model the native runtime supports.
        draft: "head" (the target's trained head), a head folder, or a HeadDrafter; or "ngram" (a ContextDrafter
            without a model): several matches of the context as branches (drafters/context_tree.py), with
            tree=(matches, length, nodes).
        tree: (branch, depth, nodes) of the dynamic tree, nodes <= 64 including the root; chains: (K, L) K sampled
            chains of L tokens instead (then ``scheme`` selects: specinfer, spectr, is, ...).
        sampling: the target's SamplingParams (scalars); draft_sampling: the chains' draft law (default: sampling).
        compile: False / "eager" (transformers modules), "native" (the native decoder eagerly, any device) or
            "native-graphs" / True (compiled, CUDA graphs; "native" on CPU).
        sampler: the categorical draw of the selection, 'cdf' (one uniform) or 'gumbel'.
        cache_slack: extra KV slots per request for the holes ragged acceptance leaves (default: max_new_tokens x
            (depth + 1) when B > 1); when the write pointer reaches the capacity the caches are defragmented.
    """

    def __init__(self, target, draft="head", *, tree: Optional[Sequence[int]] = (8, 6, 32),
                 chains: Optional[Sequence[int]] = None, scheme: str = "specinfer",
                 sampling: SamplingParams = SamplingParams(), draft_sampling: Optional[SamplingParams] = None,
                 compile: bool | str = True, tokenizer=None, eos_token_id=None, pad_token_id: Optional[int] = None,
                 chat: bool = True, sampler: str = "cdf", cache_slack: Optional[int] = None):
        if not hasattr(target, "config"):
            raise TypeError(f"target must be a Hugging Face model, got {type(target).__name__}")
        drafter = resolve_drafter(draft)
        self.context = isinstance(drafter, ContextDrafter) and drafter.model is None
        self.model_draft = isinstance(drafter, ModelDrafter)
        if not (self.context or self.model_draft) and (not isinstance(drafter, HeadDrafter)
                                                       or drafter.context is not None):
            raise ValueError("tree decoding drafts with a head (draft='head', a head folder or a HeadDrafter), a "
                             "draft model (chains=(K, L)) or from the context (draft='ngram': several n-gram matches "
                             "as branches)")
        if self.context and chains is not None:
            raise ValueError("context trees are deterministic drafts: use tree=(matches, length, nodes), not chains")
        if self.model_draft:
            if chains is None:
                raise ValueError("a draft model proposes K sampled chains: pass chains=(K, L)")
            tv = target.get_output_embeddings().weight.shape[0]
            dv = drafter.model.get_output_embeddings().weight.shape[0]
            if tv != dv:
                raise ValueError(f"vocabulary mismatch: target has {tv} output tokens, draft has {dv}")
        elif not self.context:
            drafter.attach(target)
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if any(float(x) != 1.0 for x in torch.as_tensor(sampling.lenience).reshape(-1).tolist()):
            raise ValueError("tree decoding is exact only: lenience < 1 is not supported")
        dev = next(target.parameters()).device
        if compile is True:
            compile = "native-graphs" if dev.type == "cuda" else "native"
        compile = "eager" if compile is False else compile
        if compile not in TREE_MODES:
            raise ValueError(f"tree decoding runs eagerly or on the native runtime: compile must be one of "
                             f"{TREE_MODES}, True or False, got {compile!r}")
        if chains is not None:
            k, length = (int(x) for x in chains)
            if k < 1 or length < 1 or 1 + k * length > 64:
                raise ValueError(f"chains=(K, L) needs K, L >= 1 and 1 + K L <= 64 nodes, got {tuple(chains)}")
            # each candidate is judged under the law it was sampled from (its own chain's forward); SpecTr is defined
            # for identical drafts, so it takes the first alive chain's law for all (equal up to float rounding)
            self._identical = parse_scheme(scheme).kind == "spectr"
            self.chains, self.tree = (k, length), None
        else:
            branch, depth, nodes = (int(x) for x in tree)
            if branch < 1 or depth < 1 or not 2 <= nodes <= 64:
                raise ValueError(f"tree=(branch, depth, nodes) needs branch, depth >= 1 and 2 <= nodes <= 64, "
                                 f"got {tuple(tree)}")
            if not self.context and nodes - 1 > tree_candidates(branch, depth):
                raise ValueError(f"tree {tuple(tree)}: at most {tree_candidates(branch, depth)} candidates for "
                                 f"{nodes - 1} nodes; raise branch or depth")
            self.tree, self.chains = (branch, depth, nodes), None
        self.target, self.drafter, self.head = target, drafter, getattr(drafter, "head", None)
        self.scheme, self.sampling, self.sampler = scheme, sampling, sampler
        self.draft_sampling = draft_sampling or sampling
        self.compile, self.tokenizer, self.chat, self.device = compile, tokenizer, chat, dev
        self.eos = eos_ids(target, tokenizer, eos_token_id)
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id
        self.pad_id = int(pad_token_id) if pad_token_id is not None else (min(self.eos) if self.eos else 0)
        self.cache_slack = cache_slack
        self._graphs: dict = {}
        self.capture_steps = compile == "native-graphs"   # dynamic-tree steps as whole-step CUDA graphs
        self.last_stats: Optional[TreeStats] = None

    # ------------------------------------------------------------------ shapes
    @property
    def nodes(self) -> int:
        return self.tree[2] if self.tree is not None else 1 + self.chains[0] * self.chains[1]

    @property
    def depth(self) -> int:
        return self.tree[1] if self.tree is not None else self.chains[1]

    def _window(self) -> int:
        """Slots from W that one step writes (target tree, head draft slots, observed path)."""
        head_slots = 0 if self.context else \
            (self.depth - 1) * (self.tree[0] if self.tree is not None else self.chains[0])
        return max(self.nodes, head_slots, self.depth + 1) + 1

    # ------------------------------------------------------------------ one step
    def _device_step(self, hidden, pending, valid, seq_len, seeds, write, target, head, key=None,
                     write_slot=None) -> tuple:
        """Dynamic tree: the whole step on device tensors (capturable with ``write_slot`` None); returns
        TreeStepOutput fields."""
        branch, depth, nodes = self.tree
        tree = propose_tree(head, hidden, pending, valid, seq_len, write, branch, depth, nodes)
        logits, feats = score_tree(target, tree, valid, seq_len, write, capture=head.features, write_slot=write_slot)
        out = finish_step(target, head, tree, logits, feats, valid, seq_len, seeds, write, self.sampling,
                          self.scheme, self.sampler, max_depth=depth)
        return out.num_emitted, out.output_tokens, out.path_tokens, out.hidden

    def _step(self, state: BatchState, target, head, write: torch.Tensor, stats: TreeStats,
              histories: Optional[list] = None, draft_law: Optional[torch.Tensor] = None) -> TreeStepOutput:
        if self.model_draft:
            k, length = self.chains
            resolved = resolve_sampling(self.draft_sampling, state.size, self.device)
            tree = propose_model_chains(head, draft_law, state.pending, state.valid, state.seq_len, state.seeds,
                                        state.write, resolved, k, length)
            tree.identical = self._identical
            logits = score_tree(target, tree, state.valid, state.seq_len, write, write_slot=state.write)
            return finish_step(target, None, tree, logits, None, state.valid, state.seq_len, state.seeds, write,
                               self.sampling, self.scheme, self.sampler)
        if self.context:
            matches, length, nodes = self.tree
            tree = context_trees(histories, matches, length, nodes, self.device)
            logits = score_tree(target, tree, state.valid, state.seq_len, write, write_slot=state.write)
            return finish_step(target, None, tree, logits, None, state.valid, state.seq_len, state.seeds, write,
                               self.sampling, self.scheme, self.sampler)
        if self.tree is not None:
            args = (state.hidden, state.pending, state.valid, state.seq_len, state.seeds, write)
            graphs = self._graphs.get((id(target), id(head))) if self.capture_steps else None
            if graphs is not None:
                try:
                    # a runner that replaced its K/V buffers (new batch size, dropped rows) needs a new capture
                    res = graphs(*args, key=(id(target), target.cache_version, id(head), head.cache_version))
                    stats.graphed = True
                    return TreeStepOutput(*(t.clone() for t in res), tree_sizes=None)
                except Exception as err:   # noqa: BLE001 - stay correct where a capture fails: eager from now on
                    warnings.warn(f"capturing the tree step failed ({err}); running it eagerly")
                    self._graphs[id(target), id(head)] = None
                    torch.cuda.synchronize(self.device)
            res = self._device_step(*args, target, head, write_slot=state.write)
            return TreeStepOutput(*res, tree_sizes=None)
        k, length = self.chains
        resolved = resolve_sampling(self.draft_sampling, state.size, self.device)
        tree = propose_chains(head, state.hidden, state.pending, state.valid, state.seq_len, state.seeds, write,
                              resolved, k, length)
        tree.identical = self._identical
        logits, feats = score_tree(target, tree, state.valid, state.seq_len, write, capture=head.features,
                                   write_slot=state.write)
        return finish_step(target, head, tree, logits, feats, state.valid, state.seq_len, state.seeds, write,
                           self.sampling, self.scheme, self.sampler)

    # ------------------------------------------------------------------ generation
    @torch.inference_mode()
    def generate(self, input_ids=None, *, prompts=None, max_new_tokens: int = 64, seed=0) -> TreeOutput:
        """Decode to completion: new tokens per request (EOS included), texts with a tokenizer, and TreeStats."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        lists = prompt_lists(self.tokenizer, input_ids, prompts, self.chat)
        seeds = check_request(self.target, None, lists, max_new_tokens, seed, self.sampling)
        batch = len(lists)
        t0 = time.perf_counter()
        ids, is_tok = left_pad(lists, self.pad_id, self.device)
        width = ids.shape[1]
        slack = self.cache_slack if self.cache_slack is not None else \
            (0 if batch == 1 else max_new_tokens * (self.depth + 1))
        capacity = width + max_new_tokens + slack + self._window() + 2
        if self.compile == "native-graphs":   # round up so prompts of similar length reuse the captured graphs
            capacity = -(-capacity // 256) * 256
        mode = False if self.compile == "eager" else self.compile
        target = shared_runner(self.target, "target", capacity, batch, mode)
        if self.model_draft:     # "head" below is the draft model's runner
            head = shared_runner(self.drafter.model, "draft", capacity, batch, mode)
        else:
            head = None if self.context else self.drafter.runner(batch, capacity, target=target)
        p = width - 1
        pad_valid = is_tok[:, :p]
        positions = (pad_valid.long().cumsum(dim=1) - 1).clamp(min=0)
        pmask = prefill_mask(pad_valid, capacity)
        state = BatchState.prefilled(ids, is_tok, capacity, seeds, max_new_tokens, self.eos)
        if head is not None and not self.model_draft:   # the target's prefill hands the head its features
            _, feats = target.forward(ids[:, :p], positions, pmask, 0, keep=1, capture=head.features, compiled=False)
            state.hidden = head.prefill(ids, positions, pmask, feats, False)
        else:
            for runner in (target, head) if head is not None else (target,):
                runner.forward(ids[:, :p], positions, pmask, 0, keep=1, compiled=False)
        resync = Resync.first(state.pending, state.seq_len, state.valid, state.write) if self.model_draft else None
        draft_resolved = resolve_sampling(self.draft_sampling, batch, self.device)
        dynamic_tree = self.tree is not None and not self.context
        if self.capture_steps and dynamic_tree and (id(target), id(head)) not in self._graphs:
            self._graphs[id(target), id(head)] = GraphCache(
                lambda *a, key=None, t=target, h=head: self._device_step(*a, t, h, key=key))
        stats = TreeStats(requests=batch, nodes=self.nodes)
        sequences = [[] for _ in range(batch)]
        done = [False] * batch
        write = torch.zeros((), dtype=torch.int64, device=self.device)
        while not all(done):
            draft_law = resync_law(head, resync, draft_resolved) if resync is not None else None   # before a defrag
            if state.write + self._window() > capacity:
                slot_index, _ = state.plan_defrag()
                rows = torch.arange(batch, device=self.device)
                for runner in (target, head) if head is not None else (target,):
                    runner.select(rows, slot_index)
                stats.defrags += 1
                if resync is not None:    # the pending token's draft entry sat in a slot the defrag dropped
                    draft_law = resync_law(head, Resync.first(state.pending, state.seq_len, state.valid,
                                                              state.write), draft_resolved)
            write.fill_(state.write)
            histories = [list(lists[i]) + sequences[i] for i in range(batch)] if self.context else None
            out = self._step(state, target, head, write, stats, histories, draft_law)
            host = torch.cat([out.num_emitted[:, None], out.output_tokens], dim=1).cpu()   # the one sync
            emitted = host[:, 0].tolist()
            old = (state.pending, state.seq_len, state.valid, state.write)
            state.commit(out.num_emitted, out.output_tokens, out.path_tokens, max(emitted) - 1)
            if resync is not None:
                resync = Resync.after(*old, out.path_tokens, out.num_emitted, state.pending)
            state.hidden = out.hidden
            stats.steps += 1
            for i in range(batch):
                if done[i]:
                    continue
                stats.accepted.append(emitted[i] - 1)
                for tok in host[i, 1:1 + emitted[i]].tolist():
                    sequences[i].append(tok)
                    if tok in self.eos or len(sequences[i]) >= max_new_tokens:
                        done[i] = True
                        state.valid[i] = False     # a finished row keeps no context: it never fills the cache
                        break
        stats.new_tokens = sum(len(s) for s in sequences)
        stats.wall_time = time.perf_counter() - t0
        self.last_stats = stats
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(s, skip_special_tokens=True) for s in sequences]
        return TreeOutput(sequences=sequences, stats=stats, texts=texts)
