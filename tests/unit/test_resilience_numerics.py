"""Non-finite steps, the parts that need no process group: the detector's
decisions, the loss riding in the grad norm, the sampler's skip, the nan
fault, the console lines and the config keys (the multi-rank story:
tests/multirank/test_train_numerics.py)."""
from __future__ import annotations

import math

import pytest
import torch

from megaresil.config import ConfigError, field_docs, load_recipe, parse_faults
from megaresil.data.sampler import skip_past
from megaresil.events import EventLog, read_events
from megaresil.parallel.layout import ParallelLayout
from megaresil.resilience.faults import FaultInjector, fault_id
from megaresil.resilience.step_faults import poison_with_nan
from megaresil.resilience.incidents import describe
from megaresil.resilience.numerics import (Figures, differing_ranks, nonfinite_ranks,
                                           rollback_refusal, same_bits, what_is_nonfinite)
from megaresil.train.optim import reduce_grad_norm

from tests.harness.cli import ROOT

NAN, INF = float("nan"), float("inf")


def test_ranks_that_differ_on_replay_are_named():
    first = [Figures(2.5, 1.0), Figures(2.5, NAN), Figures(2.5, 1.0)]
    second = [Figures(2.5, 1.0), Figures(2.5, 3.0), Figures(2.5, 1.0)]
    assert nonfinite_ranks(first) == [1] and nonfinite_ranks(second) == []
    assert differing_ranks(first, second) == [1]
    # Persistent and deterministic: the same NaN twice is no difference.
    assert differing_ranks(first, first) == []
    assert same_bits(NAN, NAN) and not same_bits(NAN, 1.0) and same_bits(0.0, -0.0)


def test_what_is_nonfinite_and_the_rollback_limit():
    assert what_is_nonfinite([Figures(NAN, 1.0), Figures(2.0, 1.0)]) == "loss"
    assert what_is_nonfinite([Figures(2.0, 1.0), Figures(2.0, INF)]) == "grad_norm"
    assert what_is_nonfinite([Figures(NAN, 1.0), Figures(2.0, NAN)]) == "loss and grad_norm"
    assert rollback_refusal(7, made=2, limit=3) is None
    line = rollback_refusal(7, made=3, limit=3)
    assert "step 7" in line and "max_rollbacks=3" in line and "\n" not in line
    assert rollback_refusal(7, made=0, limit=0) is not None


@pytest.mark.parametrize("loss", [0.0, 2.75, 1e-30, 3.4e38])
def test_a_finite_loss_leaves_the_norm_bit_identical(loss):
    layout = ParallelLayout(device=torch.device("cpu"))
    squared = torch.tensor(1.2345678901234567, dtype=torch.float64)
    plain = squared.clone().sqrt().float()
    folded, stage_loss = reduce_grad_norm(squared.clone(), layout, sharded_over_dp=False,
                                          loss=torch.tensor(loss))
    assert torch.equal(plain, folded) and plain.dtype == folded.dtype
    assert torch.equal(stage_loss, torch.tensor(loss))  # every stage learns the loss, exactly


@pytest.mark.parametrize("loss", [NAN, INF, -INF])
def test_a_nonfinite_loss_makes_the_norm_nan(loss):
    layout = ParallelLayout(device=torch.device("cpu"))
    norm, _ = reduce_grad_norm(torch.tensor(4.0, dtype=torch.float64), layout,
                               sharded_over_dp=False, loss=torch.tensor(loss))
    assert math.isnan(norm.item())


def test_the_sampler_passes_over_skipped_batches():
    assert skip_past(40, {}) == 40
    assert skip_past(40, {40: 8}) == 48
    assert skip_past(40, {40: 8, 48: 8, 64: 8}) == 56  # two in a row
    assert skip_past(32, {40: 8}) == 32


def test_nan_faults_parse_and_refuse_persistent_elsewhere():
    spec, = parse_faults([{"kind": "nan", "rank": 1, "step": 5, "persistent": True}])
    assert spec.every_attempt and spec.fires_in == "optimizer"
    assert fault_id(spec) == "nan@rank1/step5/optimizer"
    with pytest.raises(ConfigError, match=r"faults\[0\].persistent"):
        parse_faults([{"kind": "kill", "rank": 1, "step": 5, "persistent": True}])
    with pytest.raises(ConfigError, match=r"faults\[0\].persistent"):
        parse_faults([{"kind": "nan", "rank": 1, "step": 5, "persistent": "yes"}])


def injector(tmp_path, faults) -> FaultInjector:
    return FaultInjector(faults, rank=1, run_dir=tmp_path, checkpoint_root=tmp_path / "ck",
                         events=EventLog(tmp_path, 1))


def test_a_transient_nan_fires_on_the_first_attempt_only(tmp_path):
    faults = injector(tmp_path, [{"kind": "nan", "rank": 1, "step": 5}])
    faults.on_section("optimizer", 5)  # not fired by a section's start
    assert [bool(faults.step_faults(s, 8 * (s - 1)).due) for s in (4, 5, 5, 6)] == [
        False, True, False, False]
    assert [e["event"] for e in read_events(tmp_path)] == ["fault_injected"]


def test_a_persistent_nan_hits_every_attempt_of_its_batch(tmp_path):
    faults = injector(tmp_path, [{"kind": "nan", "rank": 1, "step": 5, "persistent": True}])
    hits = lambda step, position: bool(faults.step_faults(step, position).due)
    assert hits(5, 32) and hits(5, 32)
    assert hits(3, 32)  # the same batch again after a rollback
    assert not hits(5, 40)  # its batch skipped: cured


def test_a_fault_fires_once_per_run_directory(tmp_path):
    injector(tmp_path, [{"kind": "nan", "rank": 1, "step": 5}]).step_faults(5, 32)
    assert not injector(tmp_path, [{"kind": "nan", "rank": 1, "step": 5}]).step_faults(5, 32).due


def test_poison_skips_empty_grads():
    grads = [torch.zeros(0), torch.ones(2, 2)]
    poison_with_nan(grads)
    assert math.isnan(grads[1][0, 0].item()) and grads[1].isnan().sum() == 1


def test_each_numerics_event_is_one_console_line():
    lines = [describe(e) for e in [
        {"event": "nonfinite_detected", "rank": 0, "step": 5, "what": "loss", "ranks": [1],
         "next": "update not applied; replaying step 5"},
        {"event": "step_replayed", "step": 5, "outcome": "transient", "differed_ranks": [1],
         "next": "continuing with the replayed step"},
        {"event": "step_replayed", "step": 5, "outcome": "persistent", "differed_ranks": [],
         "next": "rolling back"},
        {"event": "rolled_back", "step": 6, "to_step": 4, "rollback": 1, "max_rollbacks": 3,
         "next": "training again from step 5"},
        {"event": "samples_skipped", "step": 6, "samples": [40, 48], "next": "go on"},
        {"event": "checkpoint_refused", "step": 4, "reason": "non-finite values"}]]
    assert all(line.startswith("megaresil: ") and "\n" not in line for line in lines)
    assert "rank(s) [1]" in lines[0] and "step 5" in lines[0] and "replaying" in lines[0]
    assert "transient" in lines[1] and "persistent" in lines[2] and "no single rank" in lines[2]
    assert "step 4" in lines[3] and "samples 40..47" in lines[4]


def test_numerics_keys_are_documented_and_checked():
    docs = {key: text for key, _, _, text in field_docs()}
    assert "enabled" in docs["resilience.numerics.enabled"].lower() or \
        docs["resilience.numerics.enabled"]
    assert "Allowed: >= 0" in docs["resilience.numerics.max_rollbacks"]
    cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", [])
    assert cfg.resilience.numerics.enabled and cfg.resilience.numerics.max_rollbacks == 3
    with pytest.raises(ConfigError, match="resilience.numerics.max_rollbacks"):
        load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", ["resilience.numerics.max_rollbacks=-1"])


def test_skips_ride_in_the_run_record_and_merge_with_the_recipes():
    """A checkpoint saved after a rollback records the skipped batch (even one
    still ahead of its data position), and a resume from it skips it again,
    beside what resilience.numerics.skip_batches asks for."""
    from megaresil.checkpoint.state import RunRecord
    from megaresil.train.progress import Progress
    from megaresil.train.state import LiveTrainingState

    layout = ParallelLayout(device=torch.device("cpu"))
    param = torch.nn.Parameter(torch.zeros(2))

    def state(overrides, position):
        cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", overrides)
        return LiveTrainingState(cfg, layout, [("w", param)], torch.optim.AdamW([param]),
                                 position)

    saved = state([], Progress(step=5, consumed_samples=40, skipped={40: 8}))
    record = RunRecord.from_manifest(saved.run_record().to_manifest())
    assert record.extra["skipped_batches"] == [[40, 8]]
    resumed = Progress()
    state(["resilience.numerics.skip_batches=[[96, 8]]"], resumed).restore(record)
    assert (resumed.consumed_samples, resumed.skipped) == (40, {40: 8, 96: 8})
    assert skip_past(resumed.consumed_samples, resumed.skipped) == 48


@pytest.mark.parametrize("skips", ["[[40]]", "[[-8, 8]]", "[[40, 0]]", "[40, 8]"])
def test_skip_batches_are_checked(skips):
    with pytest.raises(ConfigError, match=r"resilience.numerics.skip_batches"):
        load_recipe(ROOT / "recipes" / "gpt-tiny.yaml",
                    [f"resilience.numerics.skip_batches={skips}"])
