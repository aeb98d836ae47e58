"""Checkpoints of an expert-parallel run (4 ranks, dp4 with ZeRO-1, a mixture
of experts): a resume at the same ep is bit-identical; a resume at ep 1 or
ep 4 from an ep 2 save reaches the uninterrupted run's next checkpoint,
weights and AdamW moments alike (DeepSpeed #8147 left the moments stale);
`megaresil convert` rewrites it at another ep unchanged; `ckpt inspect`
lists its experts; a byte flipped in an expert slab is named on load.
Under sharded data parallelism (dp_shard=4: the experts' rows over the
dp_shard / ep ranks) a resume is bit-identical, and the ZeRO-1 save
resumes there as the uninterrupted run goes on."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint.offline.diff import diff_checkpoints
from megaresil.checkpoint.offline.inspect import verify
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.sources import CheckpointSource
from megaresil.cli import main
from megaresil.events import read_events, read_metrics
from tests.harness.dist import MOE, Case, run_cases

OPTS = MOE + ["parallel.dp=4", "optimizer.distributed=true", "train.precision=fp32"]
SAVED = "checkpoints/step_0000004"
FSDP = MOE + ["parallel.dp=4", "train.precision=fp32", "parallel.ep=2", "parallel.dp_shard=4"]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("expert_parallel")
    load = f"checkpoint.load={out / 'exact_ep2' / SAVED}"
    run_cases(4, [Case("straight_ep2", OPTS + ["parallel.ep=2", "checkpoint.interval=5"]),
                  Case("exact_ep2", OPTS + ["parallel.ep=2", "train.exit_at_step=4"],
                       resume=True),
                  Case("to_ep1", OPTS + [load, "train.exit_at_step=5"]),
                  Case("to_ep4", OPTS + ["parallel.ep=4", load, "train.exit_at_step=5"]),
                  Case("to_fsdp", FSDP + [load, "train.exit_at_step=5"]),
                  Case("straight_fsdp", FSDP + ["checkpoint.interval=5"]),
                  Case("exact_fsdp", FSDP + ["train.exit_at_step=4"], resume=True)], out)
    return out


@pytest.mark.parametrize("mode", ["ep2", "fsdp"])
def test_a_resume_at_the_same_ep_is_bit_identical(runs, mode):
    straight, resumed = losses(runs / f"straight_{mode}"), losses(runs / f"exact_{mode}")
    assert sorted(resumed) == list(range(1, 11))
    for step in range(5, 11):
        assert resumed[step] == straight[step], f"step {step}"


@pytest.mark.parametrize("target", ["to_ep1", "to_ep4", "to_fsdp"])
def test_a_resume_at_another_ep_carries_the_moments(runs, target):
    loaded = next(e for e in read_events(runs / target) if e["event"] == "checkpoint_loaded")
    assert loaded["saved_layout"]["ep"] == 2
    straight = losses(runs / "straight_ep2")
    assert abs(losses(runs / target)[5] - straight[5]) <= 1e-5 * straight[5]
    report = diff_checkpoints(runs / target / "checkpoints" / "step_0000005",
                              runs / "straight_ep2" / "checkpoints" / "step_0000005",
                              atol=1e-7, rtol=1e-4)
    assert not report.only_in_a and not report.only_in_b
    assert any(k.key.startswith("optim/exp_avg_sq/layers.1.mlp.experts") for k in report.keys)
    assert report.within, [(k.key, k.max_abs) for k in report.keys if not k.within][:3]


@pytest.mark.parametrize("layout", [["--dp", "2", "--ep", "1"],
                                    ["--tp", "2", "--dp", "2", "--ep", "2"],
                                    ["--set", "parallel.ep=4"]])
def test_convert_rewrites_it_at_another_ep(runs, tmp_path, layout):
    source = runs / "exact_ep2" / SAVED
    assert main(["convert", str(source), str(tmp_path / "converted"), *layout]) == 0
    report = diff_checkpoints(source, tmp_path / "converted")
    assert report.identical, [k.key for k in report.keys if not k.identical][:3]


def test_inspect_lists_the_experts_of_an_expert_parallel_checkpoint(runs, capsys):
    assert main(["ckpt", "inspect", str(runs / "exact_ep2" / SAVED), "--tensors"]) == 0
    assert "layers.1.mlp.experts.gate" in capsys.readouterr().out


def test_a_flipped_byte_in_an_expert_slab_is_named(runs, tmp_path):
    """A byte flipped in the slab of an expert stack that a rank other than 0
    wrote (found by its bytes in that rank's file) fails the checksum every
    load verifies, naming the stack and the rank: a resume skips the
    checkpoint for the one before it (train/checkpointing.py, `choose`)."""
    saved = shutil.copytree(runs / "straight_ep2" / "checkpoints" / "step_0000010",
                            tmp_path / "step_0000010")
    key = "model/layers.1.mlp.experts.up"
    entry = CheckpointSource(saved).tensors[key]
    shard = next(s for s in entry["shards"] if s["rank"] != 0)
    slab = torch.empty(shard["shape"], dtype=torch.float32)
    CheckpointSource(saved).read([Rect(key, tuple(entry["global_shape"]),
                                       tuple(shard["offset"]), slab)])
    needle = slab.numpy().tobytes()[:64]
    [written] = [p for p in saved.rglob("*.distcp") if needle in p.read_bytes()]
    data = bytearray(written.read_bytes())
    data[data.index(needle) + 7] ^= 0x10
    written.write_bytes(bytes(data))
    reason = verify(saved)
    assert reason is not None and "checksum mismatch in " + key in reason, reason
    assert f"(written by rank {shard['rank']})" in reason, reason
