"""The native decoder (engine/native) computes what transformers computes: logits, greedy tokens, sampled tokens."""
from __future__ import annotations

import pytest
import torch

from tilespec.engine import SpeculativeDecoder
from tilespec.engine.native import NativeLlama, NativeRunner, unsupported_reason
from tilespec.engine.runner import ModelRunner, make_runner, step_mode
from tilespec.engine.state import prefill_mask
from tilespec.verify import SamplingParams

from engine_models import layer_skip, tiny_lm, tiny_whisper

PROMPTS = [[5, 17, 33, 2, 9], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [100, 3]]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_logits_match_transformers(family):
    model = tiny_lm(3, family=family)
    ids = torch.tensor([[3, 9, 27, 81, 11, 5]])
    with torch.inference_mode():
        ref = model(input_ids=ids).logits
        runner = NativeRunner(model, 16)
        pos = torch.arange(6)[None]
        out = runner.forward(ids, pos, prefill_mask(torch.ones(1, 6, dtype=torch.bool), 16), 0)
        # decode one more token through the cache: must equal the full forward's last row
        nxt = torch.tensor([[42]])
        full = model(input_ids=torch.cat([ids, nxt], dim=1)).logits[:, -1]
        mask = torch.zeros(1, 1, 1, 16, dtype=torch.bool)
        mask[..., :7] = True
        step = runner.forward(nxt, torch.tensor([[6]]), mask, 6)[:, -1]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_native_shares_weights_with_the_model():
    model = tiny_lm(4)
    before = sum(p.numel() for p in model.parameters())
    NativeLlama(model)
    att = model.model.layers[0].self_attn
    assert att.q_proj.weight.untyped_storage().data_ptr() == att.k_proj.weight.untyped_storage().data_ptr()
    assert sum(p.numel() for p in model.parameters()) == before


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_model_that_decoded_natively_can_still_be_trained(family, one_thread):
    """The native runtime fuses q/k/v (and gate/up) into one tensor per layer during the first forward, which runs in
    inference mode; the fused tensors (the parameters' storage) are ordinary tensors, so training works afterwards
    and the native runtime then decodes the trained weights (greedy tokens equal transformers')."""
    model = tiny_lm(12, family=family, logit_scale=4.0)
    greedy = SamplingParams(temperature=0.0)
    SpeculativeDecoder(model, None, sampling=greedy, compile="native", eos_token_id=[]).generate([[5, 6, 7]],
                                                                                            max_new_tokens=4)
    assert not any(p.is_inference() for p in model.parameters())
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    out = SpeculativeDecoder(model, None, sampling=greedy, compile="native", eos_token_id=[]).generate(
        [[5, 6, 7]], max_new_tokens=8).sequences[0]
    ref = model.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                         max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert out == ref[0, 3:].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_native_greedy_equals_transformers_generate(family, one_thread):
    target = tiny_lm(11, family=family, logit_scale=4.0)
    draft = layer_skip(target, 1)
    for drafted in (None, draft):
        dec = SpeculativeDecoder(target, drafted, gamma=3, method="reference", compile="native",
                                 sampling=SamplingParams(temperature=0.0))
        out = dec.generate(input_ids=PROMPTS, max_new_tokens=12)
        for prompt, seq in zip(PROMPTS, out.sequences):
            ref = target.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                  max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert seq == ref[0, len(prompt):].tolist()


def test_native_sampling_equals_the_transformers_path(one_thread):
    target = tiny_lm(12, logit_scale=2.0)
    draft = layer_skip(target, 1)
    kwargs = dict(gamma=2, method="reference", sampling=SamplingParams(temperature=1.0), eos_token_id=-1, pad_token_id=0)
    eager = SpeculativeDecoder(target, draft, compile=False, **kwargs).generate(input_ids=PROMPTS, max_new_tokens=10,
                                                                                 seed=5)
    native = SpeculativeDecoder(target, draft, compile="native", **kwargs).generate(input_ids=PROMPTS,
                                                                                    max_new_tokens=10, seed=5)
    assert native.sequences == eager.sequences


def test_runner_selection():
    cpu = torch.device("cpu")
    llama = tiny_lm(1)
    assert step_mode(True, cpu, llama) == "eager"
    assert step_mode("native", cpu, llama) == "native"
    assert isinstance(make_runner(llama, 8, compile="native"), NativeRunner)
    assert isinstance(make_runner(llama, 8, compile=False), ModelRunner)
    assert isinstance(make_runner(tiny_whisper(1), 8, compile="native"), NativeRunner)
    gemma_like = torch.nn.Linear(2, 2)
    gemma_like.config = llama.config
    assert unsupported_reason(gemma_like) is not None
    with pytest.raises(ValueError, match="CUDA"):
        make_runner(llama, 8, compile="native-graphs")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_native_graphs_equal_native_eager_on_gpu(temperature):
    target = tiny_lm(21, logit_scale=3.0).cuda()
    draft = layer_skip(target, 1).cuda()
    kwargs = dict(gamma=3, method="fused", sampling=SamplingParams(temperature=temperature), eos_token_id=-1, pad_token_id=0)
    ref = SpeculativeDecoder(target, draft, compile="native", **kwargs).generate(input_ids=PROMPTS,
                                                                                 max_new_tokens=16, seed=3)
    fast = SpeculativeDecoder(target, draft, compile=True, **kwargs)
    out = fast.generate(input_ids=PROMPTS, max_new_tokens=16, seed=3)
    assert out.sequences == ref.sequences
    assert out.stats.runtime == "native-graphs"


@pytest.mark.gpu
@cuda
def test_native_bf16_logits_within_tolerance_on_gpu():
    model = tiny_lm(22).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 128, (2, 9), device="cuda")
    with torch.inference_mode():
        ref = model(input_ids=ids).logits.float()
        runner = NativeRunner(model, 32, mode="native-graphs")
        pos = torch.arange(9, device="cuda")[None].expand(2, 9)
        out = runner.forward(ids, pos, prefill_mask(torch.ones(2, 9, dtype=torch.bool, device="cuda"), 32), 0)
    assert (out - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_native_step_functions_with_context_drafts(one_thread):
    """Ragged n-gram drafts through the native step functions (device commit) equal target-only decoding."""
    target = tiny_lm(13, logit_scale=4.0)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9], [3, 4]]
    base = SpeculativeDecoder(target, None, compile="native", sampling=SamplingParams(temperature=0.0))
    ref = base.generate(input_ids=prompts, max_new_tokens=16)
    dec = SpeculativeDecoder(target, "ngram", gamma=4, compile="native", method="reference",
                             sampling=SamplingParams(temperature=0.0))
    out = dec.generate(input_ids=prompts, max_new_tokens=16)
    assert out.sequences == ref.sequences
    assert out.stats.context_steps > 0 and out.stats.runtime == "native"


def test_run_ahead_target_only_with_eos_and_lengths(one_thread):
    """Target-only native steps run one step ahead of the host read: rows ending by EOS mid-batch keep exactly the
    tokens the transformers path gives, and the extra step is not counted as emitted tokens."""
    target = tiny_lm(14, logit_scale=4.0)
    kwargs = dict(sampling=SamplingParams(temperature=0.0), pad_token_id=0)
    first = SpeculativeDecoder(target, None, eos_token_id=-1, **kwargs).generate(input_ids=PROMPTS, max_new_tokens=6)
    eos = first.sequences[1][2]                       # request 1 ends at its third token
    ref = SpeculativeDecoder(target, None, eos_token_id=eos, **kwargs).generate(input_ids=PROMPTS, max_new_tokens=9)
    out = SpeculativeDecoder(target, None, eos_token_id=eos, compile="native", **kwargs).generate(
        input_ids=PROMPTS, max_new_tokens=9)
    assert out.sequences == ref.sequences and out.finish_reasons == ref.finish_reasons
    assert out.stats.new_tokens == sum(map(len, ref.sequences))
    assert out.stats.emitted == ref.stats.emitted



@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_run_ahead_target_only_on_cuda_graphs(temperature):
    """On CUDA the run-ahead step reads its tokens from a pinned copy taken at launch: every token (the first one
    included) equals the eager native path's, with EOS mid-batch, one request and a batch."""
    target = tiny_lm(14, logit_scale=4.0).cuda()
    kwargs = dict(sampling=SamplingParams(temperature=temperature), pad_token_id=0)
    first = SpeculativeDecoder(target, None, eos_token_id=-1, compile="native", **kwargs).generate(
        input_ids=PROMPTS, max_new_tokens=6, seed=5)
    eos = first.sequences[1][2]
    for prompts in (PROMPTS[:1], PROMPTS):
        ref = SpeculativeDecoder(target, None, eos_token_id=eos, compile="native", **kwargs).generate(
            input_ids=prompts, max_new_tokens=24, seed=5)
        out = SpeculativeDecoder(target, None, eos_token_id=eos, compile=True, **kwargs).generate(
            input_ids=prompts, max_new_tokens=24, seed=5)
        assert out.stats.runtime == "native-graphs"
        assert out.sequences == ref.sequences and out.finish_reasons == ref.finish_reasons


def test_native_whisper_matches_transformers(one_thread):
    """The native Whisper decoder: same logits as transformers, and greedy speculative decoding with a layer-skip
    draft gives the eager engine's tokens."""
    from engine_models import whisper_layer_skip
    target = tiny_whisper(5)
    feats = torch.randn(2, target.config.num_mel_bins, 32)
    prompts = [[1, 2, 3], [1, 4]]
    eager = SpeculativeDecoder(target, None, compile=False, sampling=SamplingParams(temperature=0.0),
                               eos_token_id=-1, pad_token_id=0)
    native = SpeculativeDecoder(target, None, compile="native", sampling=SamplingParams(temperature=0.0),
                                eos_token_id=-1, pad_token_id=0)
    ref = eager.generate(input_ids=prompts, input_features=feats, max_new_tokens=10)
    out = native.generate(input_ids=prompts, input_features=feats, max_new_tokens=10)
    assert out.sequences == ref.sequences and out.stats.runtime == "native"
    draft = whisper_layer_skip(target, 1)
    spec = SpeculativeDecoder(target, draft, gamma=3, compile="native", method="reference",
                              sampling=SamplingParams(temperature=0.0), eos_token_id=-1, pad_token_id=0)
    assert spec.generate(input_ids=prompts, input_features=feats, max_new_tokens=10).sequences == ref.sequences
    with torch.inference_mode():
        enc = target.get_encoder()(feats).last_hidden_state
        ids = torch.tensor([[1, 2, 3, 7]] * 2)
        hf = target(encoder_outputs=(enc,), decoder_input_ids=ids).logits
        runner = NativeRunner(target, 8)
        runner.encode(feats)
        got = runner.forward(ids, torch.arange(4)[None].expand(2, 4), prefill_mask(torch.ones(2, 4, dtype=torch.bool), 8), 0)
    torch.testing.assert_close(got, hf, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@cuda
def test_native_whisper_graphs_equal_eager_on_gpu():
    from engine_models import whisper_layer_skip
    target = tiny_whisper(6).cuda()
    draft = whisper_layer_skip(target, 1).cuda()
    feats = torch.randn(2, target.config.num_mel_bins, 32, device="cuda")
    prompts = [[1, 2, 3], [1, 4]]
    kwargs = dict(gamma=2, method="fused", sampling=SamplingParams(temperature=1.0), eos_token_id=-1, pad_token_id=0)
    ref = SpeculativeDecoder(target, draft, compile="native", **kwargs).generate(
        input_ids=prompts, input_features=feats, max_new_tokens=12, seed=4)
    fast = SpeculativeDecoder(target, draft, compile=True, **kwargs)
    for _ in range(2):   # the second generation reuses the runners (cross K/V refilled in place)
        out = fast.generate(input_ids=prompts, input_features=feats, max_new_tokens=12, seed=4)
        assert out.sequences == ref.sequences and out.stats.runtime == "native-graphs"


def test_native_runner_rejects_bad_input():
    model = tiny_lm(2)
    with pytest.raises(ValueError, match="mode must be one of"):
        NativeRunner(model, 8, mode="graphs")
    with pytest.raises(ValueError, match="capacity must be positive"):
        NativeRunner(model, 0)
    runner = NativeRunner(model, 4)
    with pytest.raises(RuntimeError, match="cache overflow"):
        runner.forward(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None],
                       torch.ones(1, 1, 3, 4, dtype=torch.bool), 2)
    whisper = NativeRunner(tiny_whisper(1), 8)
    with pytest.raises(RuntimeError, match="call encode"):
        whisper.forward(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
                        torch.ones(1, 1, 1, 8, dtype=torch.bool), 0)
    with pytest.raises(TypeError, match="only for encoder-decoder"):
        runner.encode(torch.zeros(1, 2, 3))


def test_graphs_on_encoder_decoders_pick_the_native_decoder_or_say_no():
    """compile="graphs" on an encoder-decoder: Whisper runs the native captured decoder (transformers' Whisper does
    not capture); an encoder-decoder without a native path gets a clear error. Only the device type is read."""
    from transformers import BartConfig, BartForConditionalGeneration
    cuda = torch.device("cuda")
    assert step_mode("graphs", cuda, tiny_whisper(0)) == "native-graphs"
    assert step_mode("compiled-graphs", cuda, tiny_whisper(0)) == "native-graphs"
    bart = BartForConditionalGeneration(BartConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                                   encoder_attention_heads=2, decoder_attention_heads=2,
                                                   encoder_ffn_dim=32, decoder_ffn_dim=32))
    with pytest.raises(ValueError, match="encoder-decoder modules are not supported"):
        step_mode("graphs", cuda, bart)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        step_mode("graphs", torch.device("cpu"), tiny_whisper(0))


@pytest.mark.gpu
@cuda
def test_whisper_encoder_graph_equals_eager_on_gpu():
    """native-graphs replays Whisper's encoder from a CUDA graph: same hidden states as the eager encoder, fresh
    tensors per call, new inputs replayed correctly."""
    from tilespec.engine.native.runner import encoder_forward
    model = tiny_whisper(31).cuda()
    cfg = model.config
    with torch.inference_mode():
        a, b = (torch.randn(2, cfg.num_mel_bins, 2 * cfg.max_source_positions, device="cuda") for _ in range(2))
        eager_a, eager_b = (model.get_encoder()(x).last_hidden_state for x in (a, b))
        got_a = encoder_forward(model, a, graphs=True)
        got_b = encoder_forward(model, b, graphs=True)
    assert torch.allclose(got_a, eager_a, atol=1e-5) and torch.allclose(got_b, eager_b, atol=1e-5)
    assert got_a.data_ptr() != got_b.data_ptr()


def test_sdpa_backend_setting_parses_and_rejects_unknown_names():
    from torch.nn.attention import SDPBackend
    from tilespec.engine.native.llama import sdpa_backends
    assert sdpa_backends("") == ()
    assert sdpa_backends(" efficient, cudnn ") == (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)
    with pytest.raises(ValueError, match="unknown SDPA backend 'fast'"):
        sdpa_backends("efficient,fast")
