"""Where the step body runs: on the host-commit path (step.py) or inside a captured whole step (step_graph.py).

The step body (draft -> target forward -> verify -> observe, step.py) and every drafter's device side
(drafters/base.py ``DraftRunner``) reach the runners, the draft sampler and verification only through an
execution, so one body serves both paths:
  * :class:`HostExecution`: ``runner.forward`` (each runner replays its own graphs or compiled forward, float32
    logits), the runner mode's draft sampler (keyed Gumbel-max: one Triton launch on a GPU, replayed as a CUDA
    graph on the graph modes; compiled on the CPU's compiled modes), and
    ``run_verify`` (or an injected ``verify_fn``), replayed as a graph where allowed;
  * :class:`CapturedExecution`: ``runner.raw_forward`` (no graph of its own, logits in the model dtype, the write
    pointer a 0-d device tensor), the plain sampler and ``verify()`` itself -- the enclosing capture records them;
    with ``compiled`` (a real CUDA-graph capture) the step's tensor bookkeeping runs as inductor-compiled regions
    (engine/fused.py).
Neither syncs with the host.

Random streams: the draft samples token i (logical position seq_len - 1 + i) with Gumbel noise keyed by
(seed, position, PURPOSE_EXTRA, vocab id) -- a stream ``verify()`` never uses -- while ``verify()`` keys its
acceptance uniforms and residual/bonus samples by (seed, position, PURPOSE_ACCEPT / PURPOSE_SAMPLE). Positions only
ever move forward, so each random number influences the output at most once and the output law is exact.
"""
from __future__ import annotations

from typing import Callable

import torch

from tilespec.verify import rng, verify, wide_rows
from tilespec.verify.registry import no_draft_method
from tilespec.verify.sampling import sample_keyed
from tilespec.verify.types import ResolvedSampling

from .graphs import GraphCache
from .runner import CUDA_GRAPH_MODES


def sample_draft(logits: torch.Tensor, resolved: ResolvedSampling, seeds: torch.Tensor, positions: torch.Tensor,
                 greedy: bool) -> torch.Tensor:
    """Sample one token per row from the processed draft distribution: logits [B, V] -> tokens [B] int64.

    Samples exactly from exp(log_probs(logits, resolved)), the law reported to verify() as draft_logits (keyed
    Gumbel-max, ``verify.sampling.sample_keyed``: one kernel launch on a GPU).
    """
    if greedy:
        return logits.argmax(dim=-1)
    return sample_keyed(logits, resolved, seeds, positions, rng.PURPOSE_EXTRA)


_COMPILED_SAMPLER = None
SAMPLING_FLAGS = ("any_greedy", "all_greedy", "has_top_k", "has_top_p", "has_min_p", "has_lenience")


def _graph_sample(logits, seeds, positions, temperature, top_k, top_p, min_p, lenience, *, key):
    resolved = ResolvedSampling(temperature, top_k, top_p, min_p, lenience, *key)
    return sample_draft(logits, resolved, seeds, positions, greedy=False)


_SAMPLER_GRAPHS = GraphCache(_graph_sample)


def _graphed_sampler(logits, resolved, seeds, positions, greedy):
    if greedy:
        return logits.argmax(dim=-1)
    out = _SAMPLER_GRAPHS(logits, seeds, positions, resolved.temperature, resolved.top_k, resolved.top_p,
                          resolved.min_p, resolved.lenience, key=tuple(getattr(resolved, f) for f in SAMPLING_FLAGS))
    return out.clone()  # the graph's output buffer is reused by the next draft position


def mode_sampler(mode: str) -> Callable:
    """sample_draft for a runner mode (on the CPU the Philox noise over V is ~150 small PyTorch kernels, so the
    compiled modes compile it; on a GPU it is one Triton launch, replayed in a CUDA graph on the graph modes)."""
    if mode in CUDA_GRAPH_MODES:
        return _graphed_sampler
    if mode == "eager":
        return sample_draft
    return _compiled_sampler


def _compiled_sampler(logits, resolved, seeds, positions, greedy):
    global _COMPILED_SAMPLER
    if logits.is_cuda:                    # one kernel launch already (verify.sampling): nothing to compile
        return sample_draft(logits, resolved, seeds, positions, greedy)
    if _COMPILED_SAMPLER is None:
        _COMPILED_SAMPLER = torch.compile(sample_draft, dynamic=False)
    return _COMPILED_SAMPLER(logits, resolved, seeds, positions, greedy)


_ARGMAX = None


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last axis (first index on ties), [B, V] -> [B] int64. On CUDA a compiled copy of the chunked
    argmax (verify/wide_rows.py): a few rows of 151,936 entries walked by one program each take ~10-30 µs."""
    global _ARGMAX
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    if _ARGMAX is None:
        _ARGMAX = torch.compile(wide_rows.argmax, dynamic=None, fullgraph=True)
    return _ARGMAX(logits)


def _method_for(draft_tokens: torch.Tensor, target_logits: torch.Tensor, method: str, options: tuple) -> tuple:
    """(method, options) of one verify call: a step without drafts samples with ``no_draft_method`` (on a GPU the
    two-launch ``fused`` sampler instead of, say, ``reference``'s softmax over [B, V]); its options stay the chosen
    method's only when it is the chosen method."""
    if draft_tokens.shape[1]:
        return method, options
    name = no_draft_method(method, target_logits.device)
    return name, options if name == method else ()


class HostExecution:
    """The host-commit path. ``verify_call``: run_verify's signature (step.py); ``graphs``: let it replay verify()
    as a CUDA graph; ``own_sampler``: steps without drafts may use ``no_draft_method`` (False when the caller
    injected its own verify call, which then sees every step's method as chosen)."""

    captured = False
    compiled = False      # the tensor bookkeeping runs plain (engine/fused.py)

    def __init__(self, verify_call: Callable, graphs: bool, options: tuple = (), own_sampler: bool = True):
        self.verify_call, self.graphs, self.options = verify_call, graphs, options
        self.own_sampler = own_sampler

    @staticmethod
    def forward(runner, tokens, positions, mask, write, keep=None, capture: tuple = ()):
        """runner.forward -> float32 logits [B, q or keep, V] (and features [B, q, n d] with ``capture``)."""
        extra = {"capture": capture} if capture else {}
        if keep is not None:
            extra["keep"] = keep
        return runner.forward(tokens, positions, mask, write, **extra)

    @staticmethod
    def sample(logits, resolved, seeds, positions, greedy: bool, mode: str) -> torch.Tensor:
        return mode_sampler(mode)(logits, resolved, seeds, positions, greedy)

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def verify(self, target_logits, draft_tokens, draft_logits, counts, sampling, method, seeds, offsets):
        extra = {} if counts is None else {"num_draft_tokens": counts}
        options = self.options
        if self.own_sampler:
            method, options = _method_for(draft_tokens, target_logits, method, options)
        return self.verify_call(target_logits, draft_tokens, draft_logits, sampling, method, seeds, offsets,
                                graphs=self.graphs, options=options, **extra)


class CapturedExecution:
    """Inside a captured whole step (or its eager twin, the "native" CPU mode): raw forwards, plain sampler,
    ``verify()`` itself with the method's resolved ``options``. ``compiled``: inside a real CUDA-graph capture, where
    the step's pure-tensor bookkeeping (token trees) runs inductor-compiled (engine/fused.py); False for the eager
    twin, which runs the same functions plain."""

    captured = True

    def __init__(self, options: tuple = (), compiled: bool = False):
        self.options = options
        self.compiled = compiled

    @staticmethod
    def forward(runner, tokens, positions, mask, write, keep=None, capture: tuple = ()):
        """runner.raw_forward -> logits [B, q or keep, V] in the model dtype (verify() computes in fp32)."""
        return runner.raw_forward(tokens, positions, mask, write, keep=keep, capture=capture)

    @staticmethod
    def sample(logits, resolved, seeds, positions, greedy: bool, mode: str) -> torch.Tensor:
        if greedy:      # the model dtype's argmax is the fp32 one (exact upcast): no [B, V] fp32 copy
            return greedy_tokens(logits)
        return sample_draft(logits, resolved, seeds, positions, greedy)   # sample_keyed upcasts as it needs

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return greedy_tokens(logits)

    def verify(self, target_logits, draft_tokens, draft_logits, counts, sampling, method, seeds, offsets):
        method, options = _method_for(draft_tokens, target_logits, method, self.options)
        res = verify(target_logits, draft_tokens, draft_logits=draft_logits, num_draft_tokens=counts,
                     sampling=sampling, method=method, options=dict(options), seed=seeds, offsets=offsets,
                     check_values=False)
        return res.num_emitted, res.output_tokens
