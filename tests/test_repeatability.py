"""bench.repeatability's comparison: which (method, repeat) outputs differ, and at which token."""
import pytest

from bench import repeatability as rep


def test_first_divergence():
    assert rep.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert rep.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert rep.first_divergence([1, 2], [1, 2, 3]) == 2     # a prefix diverges where it ends


def test_compare_counts_pairs_and_positions():
    outputs = {("hf", 0): [[1, 2, 3], [4, 5]], ("fused", 0): [[1, 2, 3], [4, 6]], ("fused", 1): [[1, 2, 3], [4, 6]]}
    rows = {(tuple(r["a"]), tuple(r["b"])): r for r in rep.compare(outputs)}
    assert len(rows) == 3
    same = rows[(("fused", 0), ("fused", 1))]
    assert same["differing"] == 0 and same["first_divergence"] == []
    cross = rows[(("fused", 0), ("hf", 0))]
    assert cross["examples"] == 2 and cross["differing"] == 1
    assert cross["first_divergence"] == [{"example": 1, "token": 1}]


@pytest.mark.parametrize("args", [["--repeats", "0"], ["--batch", "0"], ["--methods", "fused,sigmoid"]])
def test_bad_arguments_are_rejected_before_loading_anything(args):
    with pytest.raises(SystemExit) as err:
        rep.main(args)
    assert err.value.code == 2


def test_run_order_interleaves_methods_so_first_run_and_method_are_not_confounded():
    assert rep.run_order(["hf", "fused"], 2, "interleaved") == [("hf", 0), ("fused", 0), ("hf", 1), ("fused", 1)]
    assert rep.run_order(["hf", "fused"], 2, "grouped") == [("hf", 0), ("hf", 1), ("fused", 0), ("fused", 1)]


def test_committed_chunk_reads_the_eval_record_by_example_index(tmp_path):
    import json

    raw = {"hf": [{"idx": [0, 1], "sequences": ["1 2 3", "4 5"]}, {"idx": [2, 3], "sequences": ["6", "7 8"]}],
           "fused": [{"idx": [0, 1], "sequences": ["1 2 3", "4 6"]}]}      # fused stopped after the first chunk
    path = tmp_path / "eval.json"
    other = {"hf": [{"idx": [0, 1], "sequences": ["9", "9"]}]}                # another dataset's run comes first
    path.write_text(json.dumps({"runs": [{"dataset": "xsum", "raw": other}, {"dataset": "cnndm", "raw": raw}]}))
    assert rep.committed_chunk(str(path), 1, 2, "cnndm") == {"hf": [[4, 5], [6]]}  # only methods that hold every example
    assert rep.committed_chunk(str(path), 0, 2, "cnndm") == {"hf": [[1, 2, 3], [4, 5]], "fused": [[1, 2, 3], [4, 6]]}
    assert rep.tokens("7 8") == [7, 8] and rep.tokens([7, 8]) == [7, 8]


def test_offset_past_the_eval_sample_is_rejected():
    with pytest.raises(SystemExit) as err:
        rep.main(["--dataset", "cnndm", "--offset", "190"])         # 190 + 16 > the 199 CNN/DM examples
    assert err.value.code == 2


def test_target_only_run_and_fresh_runners_are_accepted():
    a = rep.parse(["--methods", "target,tiled,fused", "--fresh"])
    assert a.methods.split(",")[0] == rep.TARGET_ONLY and a.fresh
    assert not rep.parse([]).fresh


def test_probe_feeds_the_prompt_before_the_common_prefix():
    """The runs' sequences hold new tokens only: the probe must score prompt + prefix, and reports the top-2 gap."""
    import torch

    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids):
            seen.append(input_ids[0].tolist())
            logits = torch.zeros(1, input_ids.shape[1], 8)
            logits[0, -1, 3], logits[0, -1, 5] = 16.0, 15.875           # one bf16 ulp apart at 16
            return type("Out", (), {"logits": logits})()

    outputs = {("a", 0): [[1, 2, 3]], ("b", 0): [[1, 2, 5]]}
    rows = rep.compare(outputs)
    out = rep.probe(Model(), outputs, rows, prompts=[[7, 8]])
    assert seen == [[7, 8, 1, 2]]
    assert out[0]["token"] == 2 and out[0]["top_ids"][:2] == [3, 5]
    assert out[0]["gap_ulps"] == pytest.approx(1.0)
    first = rep.probe(Model(), {("a", 0): [[3]], ("b", 0): [[5]]}, rep.compare({("a", 0): [[3]], ("b", 0): [[5]]}),
                      prompts=[[7, 8]])
    assert seen[-1] == [7, 8] and first[0]["token"] == 0       # a split at the first new token is probed too
