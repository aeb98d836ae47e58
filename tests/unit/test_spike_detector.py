"""The loss-spike detector on recorded and synthetic loss sequences (no
process group, no wall time): a new loss level is taken as one, a spike that
comes back at its step with another batch is the state's, a healthy demo run
raises no alarm, and what the detector and a spike's rollback read moves with
the state (live replacement) and is saved (checkpoints). The multi-rank
story: tests/multirank/test_train_numerics.py."""
from __future__ import annotations

import json
import random

import pytest
import torch

from megaresil.checkpoint.state import RunRecord
from megaresil.config import load_recipe
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import ShardSpec, set_spec
from megaresil.resilience.numerics import LossWatch, WatchSizes, find_spike
from megaresil.resilience.incidents import describe
from megaresil.train.handover import carried_state
from megaresil.checkpoint.local.shard import saved_run_record
from megaresil.checkpoint.transfer import decode_meta, encode_meta
from megaresil.train.progress import Progress
from megaresil.train.state import LiveTrainingState

from tests.harness.cli import ROOT

SIZES = WatchSizes(window=20, skip_window=3, level_shift=5)
CURVE = ROOT / "bench" / "results" / "spike_alarms_curve.json"


def warn(losses: list[float], sizes: WatchSizes = SIZES, threshold: float = 6.0,
         warmup: int = 0) -> tuple[list[int], list[int]]:
    """The steps a run under on_spike=warn calls spikes, and its level shifts."""
    watch, alarms, shifts = LossWatch(), [], []
    for step, loss in enumerate(losses, start=1):
        spike = step > warmup and find_spike(loss, watch.losses, sizes.window,
                                             threshold) is not None
        alarms += [step] if spike else []
        if watch.applied(step, 8 * (step - 1), loss, spike, sizes):
            shifts.append(step)
    return alarms, shifts


def noisy(level: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [level + rng.gauss(0, 0.01 * level) for _ in range(n)]


def test_a_new_loss_level_is_taken_as_one_after_a_few_spikes():
    """Before: every step after the shift was a spike against a median that
    never moved (the spikes never joined the window)."""
    before, after = noisy(3.0, 60, seed=1), noisy(4.5, 200, seed=2)
    alarms, shifts = warn(before + after)
    assert alarms == list(range(61, 66)) and shifts == [65]


def test_a_spike_that_comes_down_again_is_no_level_shift():
    losses = noisy(3.0, 60, seed=3)
    losses[40:44] = [9.0, 8.0, 7.0, 6.0]  # four spikes, then back
    alarms, shifts = warn(losses)
    assert alarms == [41, 42, 43, 44] and shifts == []
    watch = LossWatch()
    for step, loss in enumerate(losses, start=1):
        watch.applied(step, 0, loss, step in alarms, SIZES)
    assert max(watch.losses) < 3.2  # the spikes never joined the window


def test_a_spike_that_comes_back_at_its_step_is_the_states():
    watch = LossWatch(losses=[3.0] * 20)
    assert not watch.state_caused(9)
    watch.cured_step = 9  # its batch skipped (on_spike=skip or rollback)
    assert watch.state_caused(9) and not watch.state_caused(10)
    watch.applied(9, 64, 30.0, spike=True, sizes=SIZES)  # applied: the state's
    assert watch.cured_step is None and watch.streak == [30.0]
    assert watch.state_caused(10)  # the spikes that follow in a row are the state's too
    watch.applied(10, 72, 3.0, spike=False, sizes=SIZES)
    assert watch.streak == [] and not watch.state_caused(11)
    # A run that got past the step without a spike forgets it.
    watch.cured_step = 12
    watch.applied(12, 88, 3.0, spike=False, sizes=SIZES)
    assert watch.cured_step is None


def test_only_the_last_applied_starts_are_kept():
    watch = LossWatch()
    for step in range(1, 8):
        watch.applied(step, 8 * (step - 1), 3.0, spike=False, sizes=SIZES)
    assert watch.starts == [32, 40, 48]


def test_a_healthy_demo_run_raises_no_alarm():
    """The demo's recorded curve (bench/spike_alarms.py, one process, the
    defaults) replayed through the detector: no alarm at the defaults, nor
    at the minimum window over the demo's own 250 steps."""
    curve = json.loads(CURVE.read_text())
    losses = [loss for _, loss in curve]
    assert len(losses) >= 1000
    cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", [])
    settings, warmup = cfg.resilience.numerics, cfg.optimizer.warmup_steps
    defaults = WatchSizes(settings.spike_window, 1, settings.spike_level_shift)
    assert warn(losses, defaults, settings.spike_threshold, warmup) == ([], [])
    smallest = WatchSizes(5, 1, settings.spike_level_shift)
    assert warn(losses[:250], smallest, settings.spike_threshold, warmup)[0] == []


def state_with(progress: Progress) -> LiveTrainingState:
    cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", ["parallel.pp=1", "parallel.tp=1",
                                                           "parallel.dp=1"])
    # A replicated parameter, as the model's final norm makes it.
    param = set_spec(torch.nn.Parameter(torch.zeros(4)), ShardSpec())
    return LiveTrainingState(cfg, ParallelLayout(device=torch.device("cpu")),
                             [("final_norm.weight", param)], torch.optim.AdamW([param]), progress)


WATCH = LossWatch(losses=[3.5, 3.25, 3.0], starts=[40, 48, 56], streak=[9.5], cured_step=9)


def test_what_the_detector_reads_is_saved_in_checkpoints():
    record = RunRecord.from_manifest(state_with(Progress(step=8, consumed_samples=64,
                                                         watch=WATCH)).run_record().to_manifest())
    resumed = Progress()
    state_with(resumed).restore(record)
    assert resumed.watch == WATCH
    # A checkpoint of an older version: an empty watch, the window as it was saved.
    del record.extra["recent_batch_starts"], record.extra["spike_streak"]
    state_with(resumed).restore(record)
    assert resumed.watch == LossWatch(losses=[3.5, 3.25, 3.0], cured_step=9)


def test_what_the_detector_reads_moves_with_live_replacement():
    """The state a live rank carries for the next generation holds the
    batches a spike's rollback would skip: the replaced run skips what the
    run without the fault skips."""
    held = state_with(Progress(step=8, consumed_samples=64, watch=WATCH))
    carried = carried_state(held, rank=0, world=1)
    received = Progress()
    state_with(received).restore(saved_run_record(decode_meta(encode_meta(carried.meta))))
    assert received.watch == WATCH and received.consumed_samples == 64


def test_level_shifts_spikes_and_unresolved_replays_are_one_console_line_each():
    lines = [describe(e) for e in [
        {"event": "loss_level_shift", "step": 65, "steps": 5, "median": 3.0,
         "new_median": 4.5, "next": "the spike window starts again from these 5 losses"},
        {"event": "loss_spike", "step": 9, "loss": 25.1, "median": 2.5, "deviations": 40.2,
         "threshold": 6.0, "state_caused": True, "next": "update applied: the state"},
        {"event": "silent_corruption_attributed", "step": 6, "culprit": [],
         "unresolved": [[0, 1]], "why": "every replica of those changed on replay",
         "next": "training on"}]]
    assert all(line.startswith("megaresil: ") and "\n" not in line for line in lines)
    assert "level shift at step 65" in lines[0] and "from 3 to 4.5" in lines[0]
    assert "the state" in lines[1]
    assert "[[0, 1]]" in lines[2] and "not known" in lines[2] and "rank(s) []" not in lines[2]


def test_a_small_window_whose_losses_coincide_makes_no_spike():
    """The demo's healthy steps 244-248 at spike_window=5: three of the five
    losses within 0.006, so their median absolute deviation is 0.006 and the
    floor (1% of the median) decided: step 249's ordinary 5.357 was 6.2
    deviations up, a false alarm. Their mean absolute deviation sees the
    spread the window has."""
    window = [5.04, 5.368, 5.044, 5.235, 5.038]
    assert find_spike(5.357, window, size=5, threshold=6.0) is None
    assert find_spike(5.044 * 1.5, window, size=5, threshold=6.0) is not None


@pytest.mark.parametrize("window", [5, 50])
def test_the_detector_still_sees_a_spike(window):
    """What the drills inject (one replica's loss x10 at dp=2: the mean x5.5)
    and a bad batch's smaller jump stay spikes at every window."""
    losses = noisy(3.0, window, seed=4)
    for factor in (5.5, 1.5):
        assert find_spike(3.0 * factor, losses, window, 6.0) is not None
