"""The distilled Whisper draft end to end on tiny random models (CPU): trained through the library's training
function (``train_whisper_draft``, the one ``tilespec draft train`` runs) its held-out acceptance rises; saved and
loaded by path or as ``draft="distilled"``, refused for another target, missing with a message naming the command;
greedy decoding with it equals target-only decoding on the eager and the native runtime."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import tilespec
from tilespec.engine import SpeculativeDecoder
from tilespec.heads import HeadMismatch, HeadNotFound, draft_dir, load_distilled
from tilespec.models.distilled import own_state
from tilespec.training.whisper_training import train_whisper_draft
from tilespec.verify import SamplingParams

from engine_models import stub_whisper_io, tiny_whisper
from test_whisper_distill import distinct_target

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams.greedy()


class FeatureStub:
    """A processor whose feature extractor takes ready [mels, frames] arrays as the 'audio'."""

    class feature_extractor:  # noqa: N801 (mimics the processor attribute)
        def __init__(self, *a, **k):
            pass

        def __new__(cls, audios, sampling_rate=16000, return_tensors="pt", device="cpu"):
            out = type("Out", (), {})()
            out.input_features = torch.stack([torch.as_tensor(a) for a in audios])
            return out


def speech(target, n: int, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    shape = (target.config.num_mel_bins, 2 * target.config.max_source_positions)
    return [{"id": f"clip{i}", "audio": torch.randn(*shape, generator=g)} for i in range(n)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    target = distinct_target()
    folder = tmp_path_factory.mktemp("distilled")
    draft, info = train_whisper_draft(target, FeatureStub, target_name="tiny-whisper", out=folder,
                                      speech=speech(target, 16), prefix=[1], layers=(0, 3), max_new_tokens=12,
                                      label_batch=8, batch=6, lr=3e-3, warmup=10, max_steps=100, heldout=0.25,
                                      log=lambda m: None)
    return target, draft, info, folder


def test_training_raises_held_out_acceptance(trained):
    target, draft, info, folder = trained
    held = info["held_out"]
    assert info["steps"] == 100 and len(info["held_out_clips"]) == 4
    assert info["loss_first_last"][1] < 0.5 * info["loss_first_last"][0]
    assert held["alpha"] > 0.7 and held["tokens_per_step"][3] > 2.0, held
    assert 1 <= held["suggested_gamma"] <= 8
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"].startswith("tilespec-distilled-whisper") and manifest["layers"] == [0, 3]
    assert manifest["steps"] == 100 and manifest["held_out"]["alpha"] == held["alpha"]


def test_round_trip_identity_and_greedy_exactness(trained, monkeypatch):
    target, draft, info, folder = trained
    loaded = load_distilled(folder, target)
    for (name, a), b in zip(own_state(draft).items(), own_state(loaded).values()):
        assert torch.equal(a, b), name
    half = copy.deepcopy(target).to(torch.bfloat16)        # trained in fp32, used in half precision: same identity
    assert next(load_distilled(folder, half).model.decoder.layers.parameters()).dtype == torch.bfloat16
    feats = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(5))
    prompts = [[1]] * 3
    expected = SpeculativeDecoder(target, None, sampling=GREEDY, eos_token_id=[]).generate(
        prompts, max_new_tokens=16, input_features=feats).sequences
    for compile in (False, "native"):
        out = SpeculativeDecoder(target, loaded, gamma=3, sampling=GREEDY, eos_token_id=[], compile=compile).generate(
            prompts, max_new_tokens=16, input_features=feats)
        assert out.sequences == expected, compile
        assert out.stats.accepted > 0.5 * out.stats.tested
    # by path and by name through the public API (the target's registry name finds $TILESPEC_HOME/drafts/<name>)
    proc = stub_whisper_io(monkeypatch, target)
    by_path = tilespec.transcribe([torch.zeros(10).numpy()] * 2, target=target, processor=proc, draft=str(folder),
                                  max_new_tokens=8, temperature=0.0)
    assert by_path.stats.drafted > 0
    monkeypatch.setenv("TILESPEC_HOME", str(folder.parent / "home"))
    target.tilespec_name = "tiny-whisper"
    draft_dir("tiny-whisper").parent.mkdir(parents=True)
    draft_dir("tiny-whisper").symlink_to(folder)
    by_name = tilespec.transcribe([torch.zeros(10).numpy()] * 2, target=target, processor=proc, draft="distilled",
                                  max_new_tokens=8, temperature=0.0)
    assert by_name.sequences == by_path.sequences


def test_wrong_target_and_missing_draft(trained, tmp_path, monkeypatch):
    target, _, _, folder = trained
    with pytest.raises(HeadMismatch, match="trained for target 'tiny-whisper'"):
        load_distilled(folder, tiny_whisper(7, decoder_layers=4))
    monkeypatch.setenv("TILESPEC_HOME", str(tmp_path))
    other = tiny_whisper(8)
    other.tilespec_name = "whisper-other"
    proc = stub_whisper_io(monkeypatch, other)
    with pytest.raises(HeadNotFound, match="tilespec draft train --target whisper-other"):
        tilespec.transcribe([torch.zeros(10).numpy()], target=other, processor=proc, draft="distilled")


def test_resume_continues_from_the_saved_step(trained, tmp_path):
    target = trained[0]
    clips = speech(target, 6, seed=3)
    kw = dict(target_name="tiny-whisper", out=tmp_path, speech=clips, prefix=[1], layers=(0, 3), max_new_tokens=6,
              batch=4, lr=1e-3, heldout=0.2, log=lambda m: None)
    _, first = train_whisper_draft(target, FeatureStub, max_steps=5, **kw)
    _, second = train_whisper_draft(target, FeatureStub, max_steps=8, **kw)
    assert (first["steps"], second["steps"]) == (5, 8)
    with pytest.raises(ValueError, match="float32"):
        train_whisper_draft(tiny_whisper(0).to(torch.bfloat16), FeatureStub, max_steps=1, **kw)
