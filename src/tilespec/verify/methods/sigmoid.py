"""``sigmoid``: the seed paper's NON-EXACT sigmoid approximation (Wagner et al. 2024, Sec. 3.2.2, Eq. 5).

p_hat(x) = sigmoid((z_p(x) - alpha) / (beta - alpha)) (0 where z < alpha, 1 where z > beta), q_hat likewise; a
draft token is accepted with probability min(1, p_hat / (l q_hat)), a rejection samples from norm(max(0, p_hat -
l q_hat)) and the bonus token from norm(p_hat). p_hat is not the target distribution: with |logits| << |alpha|
every kept token gets nearly the same weight, so outputs are far from the target law (see
``tilespec.exactness.distortion``). NOT EXACT - opt-in only. The constants are the method's options, alpha = -1e4,
beta = 1e4 by default (the paper's text setting; use +-1e3 for ASR): ``verify(..., method="sigmoid",
options={"alpha": -1e3, "beta": 1e3})`` or ``SpeculativeDecoder(..., method_options={...})``.
"""
from __future__ import annotations

from ..registry import register_method
from ..types import VerifyInputs, VerifyResult

DEFAULT_ALPHA, DEFAULT_BETA = -1e4, 1e4


def check_constants(alpha: float, beta: float) -> None:
    if not alpha < 0 < beta:
        raise ValueError(f"sigmoid needs alpha < 0 < beta, got alpha={alpha}, beta={beta}")


@register_method("sigmoid", exact=False, graph_safe=True, needs_triton=True,
                 options={"alpha": DEFAULT_ALPHA, "beta": DEFAULT_BETA}, check_options=check_constants,
                 description="NOT EXACT; the seed paper's sigmoid approximation of softmax (alpha/beta scaling), "
                             "Triton, one launch; output law differs from the target's")
def sigmoid(inputs: VerifyInputs, alpha: float = DEFAULT_ALPHA, beta: float = DEFAULT_BETA) -> VerifyResult:
    from ..kernels.launch import sigmoid_verify
    result = sigmoid_verify(inputs, alpha, beta)
    result.extras.update(alpha=alpha, beta=beta, exact=False, note="NON-EXACT sigmoid approximation")
    return result
