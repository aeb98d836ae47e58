"""Resume across context parallelism, optimizer state included: a run at
cp=2 x dp=2 with ZeRO-1 (its shards over the four dp x cp ranks) stopped
and saved at step 5 goes on bit-identically at the same layout, and within
the resharding tolerance (test_checkpoint.py's) at cp=4, and at cp=1 with
tp=2 and dp=2, each loading the cp=2 checkpoint. Likewise sharded data
parallelism over cp (dp_shard=2 at cp=2 x dp=2: FSDP2 over the four
dp_shard x cp ranks): bit-identical in itself, and to and from the ZeRO-1
run's checkpoint within the tolerance."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends import get_backend
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.validation import read_manifest
from megaresil.events import read_events, read_metrics
from tests.harness.dist import LLAMA, Case, run_cases

# 64 tokens: 4 chunks of 16 at cp=2, 8 of 8 at cp=4; GQA (llama's 4 kv heads of 8).
SHORT = LLAMA + ["data.seq_len=64", "model.max_seq_len=64", "checkpoint.backend=torch_dist",
                 "checkpoint.interval=5"]  # saves at 5 and 10
SAVED = ["parallel.cp=2", "parallel.dp=2", "optimizer.distributed=true"]
TARGETS = {"cp4": ["parallel.cp=4"],
           "cp1_tp2_dp2": ["parallel.tp=2", "parallel.dp=2"],
           "cp2_tp2": ["parallel.cp=2", "parallel.tp=2", "optimizer.distributed=true"]}
FSDP = ["parallel.cp=2", "parallel.dp=2", "parallel.dp_shard=2"]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last line for a step winning (a resumed run appends)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def saved_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every global tensor of a torch_dist checkpoint."""
    manifest = read_manifest(path)
    rects = {}
    for key, entry in manifest["tensors"].items():
        shape, dtype = tuple(entry["global_shape"]), fmt.torch_dtype(entry["dtype"])
        rects[key] = Rect(key, shape, (0,) * len(shape), torch.empty(shape, dtype=dtype))
    get_backend("torch_dist").read(path, manifest, list(rects.values()))
    return {key: rect.tensor for key, rect in rects.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("context_resume")
    step_5 = out / "exact" / "checkpoints" / "step_0000005"
    fsdp_step_5 = out / "exact_fsdp" / "checkpoints" / "step_0000005"
    run_cases(4, [Case("straight", SHORT + SAVED),
                  Case("exact", SHORT + SAVED + ["train.exit_at_step=5"], resume=True)]
              + [Case(name, SHORT + layout + [f"checkpoint.load={step_5}"])
                 for name, layout in TARGETS.items()]
              + [Case("straight_fsdp", SHORT + FSDP),
                 Case("exact_fsdp", SHORT + FSDP + ["train.exit_at_step=5"], resume=True),
                 Case("fsdp_to_zero1", SHORT + SAVED + [f"checkpoint.load={fsdp_step_5}"]),
                 Case("zero1_to_fsdp", SHORT + FSDP + [f"checkpoint.load={step_5}"])], out)
    return out


@pytest.mark.parametrize("suffix", ["", "_fsdp"])
def test_resume_at_cp2_is_bit_identical(runs, suffix):
    straight, resumed = losses(runs / f"straight{suffix}"), losses(runs / f"exact{suffix}")
    assert sorted(resumed) == list(range(1, 11))
    for step in range(1, 11):
        assert resumed[step] == straight[step], f"step {step}"
    want = saved_tensors(runs / f"straight{suffix}" / "checkpoints" / "step_0000010")
    got = saved_tensors(runs / f"exact{suffix}" / "checkpoints" / "step_0000010")
    assert got.keys() == want.keys() and any(k.startswith("optim") for k in want), sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("target", TARGETS)
def test_resume_at_another_layout_matches_the_uninterrupted_run(runs, target):
    straight, resumed = losses(runs / "straight"), losses(runs / target)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(resumed[step] - straight[step]) <= 1e-5 * straight[step], f"step {step}"
    loaded = next(e for e in read_events(runs / target) if e["event"] == "checkpoint_loaded")
    assert loaded["saved_layout"]["world_size"] == 4
    assert loaded["saved_layout"]["distributed_optimizer"]


@pytest.mark.parametrize("saved,target", [("", "zero1_to_fsdp"), ("_fsdp", "fsdp_to_zero1")])
def test_sharded_data_over_cp_resumes_to_and_from_zero1(runs, saved, target):
    """The FSDP2 run's step-5 checkpoint (rows over dp_shard x cp) resumes
    under ZeRO-1 as the uninterrupted FSDP2 run goes on, and the other way."""
    straight, resumed = losses(runs / f"straight{saved}"), losses(runs / target)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(resumed[step] - straight[step]) <= 1e-5 * straight[step], f"step {step}"
    loaded = next(e for e in read_events(runs / target) if e["event"] == "checkpoint_loaded")
    assert loaded["saved_layout"].get("dp_shard", 1) == (2 if saved else 1)
