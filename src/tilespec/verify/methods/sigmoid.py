"""``sigmoid``: the seed paper's NON-EXACT sigmoid approximation (Wagner et al. 2024, Sec. 3.2.2, Eq. 5).

p_hat(x) = sigmoid((z_p(x) - alpha) / (beta - alpha)) (0 where z < alpha, 1 where z > beta), q_hat likewise; a
draft token is accepted with probability min(1, p_hat / (l q_hat)), a rejection samples from norm(max(0, p_hat -
l q_hat)) and the bonus token from norm(p_hat). p_hat is not the target distribution: with |logits| << |alpha|
every kept token gets nearly the same weight, so outputs are far from the target law (see
``tilespec.exactness.distortion``). NOT EXACT - opt-in only. Constants default to alpha = -1e4, beta = 1e4 (the
paper's text setting; use +-1e3 for ASR) and are set with :func:`set_constants` or ``TILESPEC_SIGMOID_ALPHA`` /
``TILESPEC_SIGMOID_BETA``.
"""
from __future__ import annotations

import os

from ..registry import register_method
from ..types import VerifyInputs, VerifyResult

_CONSTANTS = {"alpha": float(os.environ.get("TILESPEC_SIGMOID_ALPHA", -1e4)),
              "beta": float(os.environ.get("TILESPEC_SIGMOID_BETA", 1e4))}


def set_constants(alpha: float, beta: float) -> None:
    """Set the sigmoid scaling constants (alpha < 0 < beta) used by later ``method="sigmoid"`` calls."""
    if not alpha < 0 < beta:
        raise ValueError(f"sigmoid needs alpha < 0 < beta, got alpha={alpha}, beta={beta}")
    _CONSTANTS.update(alpha=float(alpha), beta=float(beta))


def get_constants() -> tuple[float, float]:
    return _CONSTANTS["alpha"], _CONSTANTS["beta"]


def sigmoid_with(inputs: VerifyInputs, alpha: float, beta: float) -> VerifyResult:
    """Run the sigmoid approximation with explicit constants (used by the distortion measurement)."""
    from ..kernels.launch import sigmoid_verify
    result = sigmoid_verify(inputs, alpha, beta)
    result.extras.update(alpha=alpha, beta=beta, exact=False, note="NON-EXACT sigmoid approximation")
    return result


@register_method("sigmoid", exact=False,
                 description="NOT EXACT; the seed paper's sigmoid approximation of softmax (alpha/beta scaling), "
                             "Triton, one launch; output law differs from the target's")
def sigmoid(inputs: VerifyInputs) -> VerifyResult:
    alpha, beta = get_constants()
    return sigmoid_with(inputs, alpha, beta)
