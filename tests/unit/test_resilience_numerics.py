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
from megaresil.resilience.numerics import (Figures, differing_ranks, find_spike,
                                           nonfinite_ranks, odd_ones_out, rollback_refusal,
                                           same_bits, skip_refusal, what_is_nonfinite)
from megaresil.resilience.step_faults import flip_bit
from megaresil.train.replicas import tensor_checksum, word_sum
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
    folded, stage_loss = reduce_grad_norm([squared.clone()], layout, loss=torch.tensor(loss))
    assert torch.equal(plain, folded) and plain.dtype == folded.dtype
    assert torch.equal(stage_loss, torch.tensor(loss))  # every stage learns the loss, exactly


@pytest.mark.parametrize("loss", [NAN, INF, -INF])
def test_a_nonfinite_loss_makes_the_norm_nan(loss):
    layout = ParallelLayout(device=torch.device("cpu"))
    norm, _ = reduce_grad_norm([torch.tensor(4.0, dtype=torch.float64)], layout,
                               loss=torch.tensor(loss))
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
        {"event": "checkpoint_refused", "step": 4, "reason": "non-finite values"},
        {"event": "nonfinite_detected", "step": 5, "what": "routing scores, loss",
         "ranks": [0, 1], "routers": [[1, "layers.1.mlp.router"]], "next": "replaying"}]]
    assert all(line.startswith("megaresil: ") and "\n" not in line for line in lines)
    assert "routing scores first at layers.1.mlp.router on rank 1" in lines[6], lines[6]
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
        cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml",
                          ["parallel.pp=1", "train.global_batch_size=8", *overrides])
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


# The demo's global batch is 16: batches start at 0, 16, 32, ...
UNREACHABLE_SKIPS = [("[[40, 16]]", 0, "does not start a global batch", "start it at 32 or 48"),
                     ("[[32, 8]]", 0, "not a whole number of global batches", "[32, 16]"),
                     ("[[32, 16], [32, 16]]", 1, "repeats or lies inside [32, 16]", "once"),
                     ("[[64, 16], [32, 48]]", 0, "[64, 16] repeats or lies inside [32, 48]",
                      "merge")]


@pytest.mark.parametrize("skips, index, problem, fix", UNREACHABLE_SKIPS)
def test_skip_batches_that_cannot_match_are_refused(skips, index, problem, fix):
    """The sampler stands only where a global batch starts: an entry
    elsewhere, a part of a batch, or one inside another skips nothing."""
    with pytest.raises(ConfigError) as err:
        load_recipe(ROOT / "recipes" / "gpt-tiny.yaml",
                    [f"resilience.numerics.skip_batches={skips}"])
    message = str(err.value)
    assert message.startswith(f"resilience.numerics.skip_batches[{index}]: "), message
    assert problem in message and fix in message.split("Fix:")[1], message
    # Whole batches from batch starts, back to back: accepted.
    load_recipe(ROOT / "recipes" / "gpt-tiny.yaml",
                ["resilience.numerics.skip_batches=[[32, 16], [48, 32], [96, 16]]"])


def test_an_unreachable_skip_stops_train_before_any_worker(cli, tmp_path):
    result = cli("train", "recipes/gpt-tiny.yaml", f"run.dir={tmp_path / 'run'}",
                 "resilience.numerics.skip_batches=[[40, 16]]", check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("megaresil: error: resilience.numerics.skip_batches[0]: [40, 16]")
    assert "Fix: start it at 32 or 48" in lines[0]
    assert not (tmp_path / "run").exists()  # no worker started, nothing written


# --- loss spikes, bit flips, replica checksums ----------------------------------------

def test_a_spike_is_measured_against_the_window_median_and_mad():
    window = [2.0, 2.1, 1.9, 2.05, 1.95]
    assert find_spike(9.0, window[:4], size=5, threshold=6.0) is None  # window not full
    spike = find_spike(9.0, window, size=5, threshold=6.0)
    assert spike.median == 2.0 and spike.deviations > 6
    assert find_spike(2.3, window, size=5, threshold=6.0) is None  # within the noise
    assert find_spike(0.1, window, size=5, threshold=6.0) is None  # falling is no fault
    # Flat losses: the deviation floor (1% of the median) keeps a wobble from alarming.
    assert find_spike(2.01, [2.0] * 5, size=5, threshold=6.0) is None
    assert find_spike(2.2, [2.0] * 5, size=5, threshold=6.0) is not None
    line = skip_refusal(9, made=3, limit=3, what="a loss spike")
    assert "step 9" in line and "on_spike=warn" in line and "\n" not in line
    assert skip_refusal(9, made=2, limit=3, what="a loss spike") is None


def test_the_odd_replica_needs_a_strict_majority():
    assert odd_ones_out([5, 5, 5]) == []
    assert odd_ones_out([5, 7, 5]) == [1]
    assert odd_ones_out([5, 7, 5, 5]) == [1]
    assert odd_ones_out([5, 7]) is None  # dp=2: a replay tells
    assert odd_ones_out([5, 5, 7, 7]) is None  # a tie
    assert odd_ones_out([5, 7, 5, 9]) == [1, 3]  # two corruptions, two healthy replicas agree
    assert odd_ones_out([5, 7, 9]) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_flip_changes_one_bit_of_one_element_chosen_by_seed(dtype):
    named = [("a", torch.randn(7, dtype=dtype)), ("b", torch.randn(3, 5, dtype=dtype))]
    before = [t.clone() for _, t in named]
    flipped = flip_bit(named, seed=11, bit=3)
    again = flip_bit([(n, t.clone()) for n, t in zip("ab", before)], seed=11, bit=3)
    assert {k: flipped[k] for k in ("tensor", "index", "bit")} == {
        k: again[k] for k in ("tensor", "index", "bit")}  # the same choice on every replica
    changed = [(n, (t != b).nonzero().flatten().tolist()) for (n, t), b in zip(named, before)
               if not torch.equal(t, b)]
    assert len(changed) == 1 and changed[0][0] == flipped["tensor"]
    tensor = dict(named)[flipped["tensor"]].reshape(-1)
    width = tensor.element_size() * 8
    original = before[0 if flipped["tensor"] == "a" else 1].reshape(-1)
    int_view = {4: torch.int32, 2: torch.int16, 8: torch.int64}[tensor.element_size()]
    xor = (tensor.view(int_view) ^ original.view(int_view))[flipped["index"]].item()
    assert xor & ((1 << width) - 1) == 1 << 3
    top = flip_bit([("x", torch.ones(1, dtype=dtype))], seed=0, bit=width - 1)
    assert top["after"] == -1.0  # the sign bit


def test_the_checksum_sees_any_one_changed_element_and_cancelling_changes():
    t = torch.randn(1000)
    base = tensor_checksum(t)
    for seed in range(40):  # elements and bits chosen by seed: mantissa, exponent, sign
        u = t.clone()
        flip_bit([("u", u)], seed=seed)
        assert not torch.equal(tensor_checksum(u), base)
    # +1 ulp here and -1 ulp there: a plain sum of bit patterns would not see it.
    u = t.clone().view(torch.int32)
    u[10] += 1
    u[20] -= 1
    assert not torch.equal(tensor_checksum(u.view(torch.float32)), base)
    assert torch.equal(tensor_checksum(t.clone()), base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_quick_sum_sees_any_one_flip_wherever_the_tensor_lies(dtype):
    """Read as int64 words: odd lengths and unaligned views (a tensor that
    starts mid-word in a flat buffer) included, and equal contents give
    equal sums wherever they lie."""
    buffer = torch.randn(1003).to(dtype)
    for start, length in [(0, 1000), (1, 7), (3, 998), (2, 1), (5, 0)]:
        t = buffer[start:start + length]
        assert torch.equal(word_sum(t), word_sum(t.clone()))
        for seed in range(8 if length else 0):
            u = buffer.clone()
            flip_bit([("u", u[start:start + length])], seed=seed)
            assert not torch.equal(word_sum(u[start:start + length]), word_sum(t))


def test_new_fault_kinds_parse_and_refuse_their_fields_elsewhere():
    spike, flip = parse_faults([{"kind": "spike", "rank": 0, "step": 9},
                                {"kind": "bitflip", "rank": 1, "step": 5, "target": "grad",
                                 "bit": 31}])
    assert spike.loss_scale == 10.0 and spike.fires_in == "optimizer"
    assert flip.flip_target.value == "grad" and flip.flip_seed == 5 and flip.bit == 31
    for bad, key in [({"kind": "kill", "scale": 2}, "scale"),
                     ({"kind": "spike", "scale": 0}, "scale"),
                     ({"kind": "bitflip", "target": "moment"}, "target"),
                     ({"kind": "bitflip", "bit": 32}, "bit"),
                     ({"kind": "nan", "seed": 1}, "seed")]:
        with pytest.raises(ConfigError, match=rf"faults\[0\].{key}"):
            parse_faults([{"rank": 0, "step": 1, **bad}])


def test_a_spike_fault_scales_the_loss_and_a_grad_flip_fires_once(tmp_path):
    faults = injector(tmp_path, [{"kind": "spike", "rank": 1, "step": 3, "scale": 4},
                                 {"kind": "bitflip", "rank": 1, "step": 3, "target": "grad"}])
    grads = [("w", torch.ones(4))]
    due = faults.step_faults(3, 16)
    due.before_update([], grads)
    assert due.loss_factor() == 4.0 and not torch.equal(grads[0][1], torch.ones(4))
    assert not faults.step_faults(3, 16).due  # the replay: no fault again
    fired = [e for e in read_events(tmp_path) if e["event"] == "fault_injected"]
    assert [e["kind"] for e in fired] == ["spike", "bitflip"] and fired[1]["tensor"] == "w"


def test_spike_and_corruption_events_are_one_console_line():
    lines = [describe(e) for e in [
        {"event": "loss_spike", "step": 9, "loss": 25.1, "median": 2.5, "deviations": 40.2,
         "threshold": 6.0, "next": "rolling back"},
        {"event": "silent_corruption_detected", "step": 5, "culprit": [2],
         "tensors": ["layers.0.attn.qkv.weight"], "next": "restored from rank 0"},
        {"event": "silent_corruption_detected", "step": 5, "culprit": None, "next": "replaying"},
        {"event": "silent_corruption_attributed", "step": 5, "culprit": [1], "next": "on"},
        {"event": "rolled_back", "step": 5, "to_step": 4, "reason": "silent_corruption",
         "next": "training again from step 5"}]]
    assert all(line.startswith("megaresil: ") and "\n" not in line for line in lines)
    assert "loss spike at step 9" in lines[0] and "40.2" in lines[0]
    assert "rank(s) [2]" in lines[1] and "qkv" in lines[1]
    assert "not known yet" in lines[2] and "rank(s) [1]" in lines[3]
    assert "replicas that differ" in lines[4] and "rollback 1" not in lines[4]


def test_the_numerics_keys_are_documented():
    docs = {key: doc for key, _, _, doc in field_docs()}
    for key in ("on_spike", "spike_window", "spike_threshold", "spike_skip_window",
                "check_interval"):
        assert docs[f"resilience.numerics.{key}"]
    with pytest.raises(ConfigError, match="on_spike"):
        load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", ["resilience.numerics.on_spike=maybe"])
