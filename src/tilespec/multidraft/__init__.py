"""Multi-draft speculative sampling (Khisti et al. 2024): token-level selection schemes, the optimal acceptance,
chain verification over K draft sequences, exactness checks and sequence-level decoding.

See docs/multidraft.md. Entry points: :func:`select`, :func:`verify_multidraft`, :func:`optimal_acceptance`.
"""
from .chain import verify_multidraft
from .common import Selection, Stream
from .optimum import acceptance_gap, lp_optimum, optimal_acceptance, optimal_acceptance_brute, theorem3_acceptance
from .schemes import SCHEMES, parse_scheme, select, accept_probability

__all__ = ["Selection", "Stream", "select", "parse_scheme", "accept_probability", "SCHEMES", "verify_multidraft",
           "optimal_acceptance", "optimal_acceptance_brute", "theorem3_acceptance", "lp_optimum", "acceptance_gap"]
