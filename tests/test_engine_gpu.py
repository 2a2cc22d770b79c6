"""The CUDA-graph fast path (compile="graphs") gives the same tokens as the eager engine (run with -m gpu)."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.graphs import GraphCache
from tilespec.engine.runner import step_mode
from tilespec.verify import SamplingParams

from engine_models import layer_skip, tiny_lm, tiny_whisper

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[5, 17, 33, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [100, 3]]


def test_step_mode_resolution():
    cpu = torch.device("cpu")
    assert step_mode(False, cpu) == "eager" and step_mode(True, cpu) == "eager"
    assert step_mode(True, torch.device("cuda")) == "graphs"
    assert step_mode("debug", cpu) == "compile"
    with pytest.raises(ValueError, match="CUDA"):
        step_mode("graphs", cpu)
    with pytest.raises(TypeError):
        step_mode(3, cpu)


def test_graph_cache_refuses_cpu_tensors():
    with pytest.raises(RuntimeError, match="CUDA"):
        GraphCache(lambda x, key=None: x * 2)(torch.ones(2))


@pytest.mark.gpu
@cuda
def test_graph_cache_replays_with_new_inputs():
    cache = GraphCache(lambda x, y, key=None: x * 2 + y)
    x = torch.arange(4.0, device="cuda")
    assert torch.equal(cache(x, x), 3 * x)
    assert torch.equal(cache(x + 1, x), 3 * x + 2)
    assert len(cache) == 1
    cache(torch.ones(3, device="cuda"), torch.ones(3, device="cuda"))
    assert len(cache) == 2


@pytest.mark.gpu
@cuda
def test_graph_caches_dropped_and_recaptured_keep_working():
    """Regression: encoder-decoder runners (and their GraphCaches) are rebuilt per generation. Capturing on a stream
    whose cuBLAS workspace was first allocated inside an earlier, since-freed graph pool broke later captures
    (CUBLAS_STATUS_EXECUTION_FAILED, then cudaErrorStreamCaptureInvalidated) once that memory was reused."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(512, 512, device="cuda", dtype=torch.float16)
    x = torch.randn(1, 512, device="cuda", dtype=torch.float16)
    expected = lin(x)
    for i in range(40):
        cache = GraphCache(lambda a, key=None: lin(a) * 1)
        assert torch.equal(cache(x), expected)
        junk = [torch.empty(1 << 20, device="cuda") for _ in range(8)]   # reuse the freed pool memory
        del cache, junk
    torch.cuda.synchronize()


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("method", ["reference", "fused"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphs_match_eager(method, temperature):
    target = tiny_lm(0, logit_scale=20.0).cuda()
    draft = layer_skip(target, 1).cuda()
    outs = {}
    for mode in (False, "graphs"):
        dec = SpeculativeDecoder(target, draft, gamma=3, gamma_schedule="heuristic", max_gamma=6, method=method,
                                 sampling=SamplingParams(temperature=temperature), eos_token_id=[], compile=mode)
        outs[mode] = [dec.generate(PROMPTS, max_new_tokens=20, seed=7).sequences,
                      dec.generate(PROMPTS[:1], max_new_tokens=20, seed=7).sequences]
    assert outs[False] == outs["graphs"]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode", [False, "graphs", True])
def test_target_only_steps_sample_with_fused_and_keep_their_tokens(mode, monkeypatch):
    """On a GPU target-only T > 0 steps sample with ``fused`` (registry.no_draft_method): the same keyed draws as
    the chosen method's PyTorch sampler (fp32 logits: no rounding to tell them apart)."""
    from tilespec.verify import registry
    target = tiny_lm(0, logit_scale=4.0).cuda()
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    outs = []
    for fused in (False, True):
        monkeypatch.setattr(registry, "_fused_sampler_on", lambda device, on=fused: on)
        dec = SpeculativeDecoder(target, None, method="reference", sampling=sampling, eos_token_id=[], compile=mode)
        outs.append(dec.generate(PROMPTS, max_new_tokens=20, seed=5).sequences)
    assert outs[0] == outs[1]


@pytest.mark.gpu
@cuda
def test_graphs_whisper_match_eager():
    target = tiny_whisper(0).cuda()
    draft = target  # self-speculation shares the encoder
    feats = torch.randn(2, target.config.num_mel_bins, 32, device="cuda")
    prompts = [[1, 2], [1, 2]]
    outs = []
    for mode in (False, "graphs"):
        dec = SpeculativeDecoder(target, draft, gamma=3, method="fused", sampling=SamplingParams.greedy(),
                                 eos_token_id=[], compile=mode)
        # several generations: the captured runners are reused with a freshly encoded input each time
        results = [dec.generate(prompts, max_new_tokens=10, input_features=feats) for _ in range(4)]
        outs.append([r.sequences for r in results])
        # "graphs" on an encoder-decoder runs the native captured decoder (transformers' Whisper does not capture)
        assert results[-1].stats.runtime == ("eager" if mode is False else "native-graphs")
    assert outs[0] == outs[1] and all(o == outs[0][0] for o in outs[0])


def test_compile_decoder_layers_in_place_and_undo():
    from tilespec.engine.runner import (_attention_free_parts, compile_decoder_layers, decoder_layers,
                                        uncompile_decoder_layers)
    target = tiny_lm(0, logit_scale=20.0)
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        before = target(x).logits
        parts = _attention_free_parts(target)
        assert len(parts) == 3 * len(decoder_layers(target)) + 2  # 2 norms + MLP per layer; final norm, rotary
        assert compile_decoder_layers(target, backend="eager") == len(parts)
        assert compile_decoder_layers(target, backend="eager") == 0  # idempotent
        assert torch.allclose(target(x).logits, before, atol=1e-5)
    uncompile_decoder_layers(target)
    assert all(part._compiled_call_impl is None for part in parts)
    with pytest.raises(ValueError, match="decoder layers"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@cuda
def test_compiled_graphs_greedy_matches_target():
    target = tiny_lm(0, logit_scale=20.0).cuda()
    draft = layer_skip(target, 1).cuda()
    eager = SpeculativeDecoder(target, None, sampling=SamplingParams.greedy(), eos_token_id=[])
    fast = SpeculativeDecoder(target, draft, gamma=3, method="fused", sampling=SamplingParams.greedy(),
                              eos_token_id=[], compile="compiled-graphs")
    assert fast.generate(PROMPTS, max_new_tokens=16).sequences == eager.generate(PROMPTS, max_new_tokens=16).sequences
