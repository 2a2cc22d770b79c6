"""Greedy exactness on a real model pair (SmolLM2-135M + layer-skip draft), fp32 CPU; skipped if not cached."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


def test_smollm2_greedy_speculative_equals_target():
    models = pytest.importorskip("tilespec.models")
    if not models.is_cached("smollm2-135m-instruct"):
        pytest.skip("smollm2-135m-instruct is not cached (tilespec models fetch smollm2-135m-instruct)")
    from tilespec.engine.prompts import encode_prompts
    from tilespec.engine import SpeculativeDecoder
    from tilespec.verify import SamplingParams

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, tok = models.load("smollm2-135m-instruct")
        draft, _ = models.load("smollm2-135m-instruct:layers=28", target=target)
        ids = encode_prompts(tok, ["What is the capital of France?", "Name three colours."], True)
        expected = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p):].tolist()
                    for p in ids]
        dec = SpeculativeDecoder(target, draft, gamma=3, sampling=SamplingParams.greedy(), tokenizer=tok)
        out = dec.generate(ids, max_new_tokens=16)
        assert out.sequences == expected
        assert out.stats.accepted > 0
    finally:
        torch.set_num_threads(old)
