"""train.rampup_batch_size: each step's global batch follows the data
position as Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator sets it,
and a ramp that some step of it could not train is refused before any worker
starts, in one line naming the key and the fix."""
import pytest
import torch

from megaresil.checkpoint.megatron.writing import megatron_args
from megaresil.checkpoint.recipe_check import recipe_changes
from megaresil.config import (BatchRamp, ConfigError, batch_start_at_or_below, global_batch_at,
                              load_recipe, to_dict)
from megaresil.data.sampler import micro_batches, skip_past

from tests.harness.cli import ROOT

TINY = str(ROOT / "recipes" / "gpt-tiny.yaml")
SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1"]


def recipe(*overrides: str):
    return load_recipe(TINY, [*SINGLE, "train.global_batch_size=32", *overrides])


def megatron_batch(consumed: int, start: int, increment: int, samples: int, final: int) -> int:
    """Megatron's update() (megatron/core/num_microbatches_calculator.py), as written."""
    if consumed > samples:
        return final
    return start + int(consumed / (samples / ((final - start) // increment))) * increment


def batches(train, steps: int) -> list[int]:
    """The global batch of each of the first `steps` steps."""
    consumed, out = 0, []
    for _ in range(steps):
        out.append(global_batch_at(train, consumed))
        consumed += out[-1]
    return out


def test_the_batch_follows_the_position_as_megatrons():
    train = recipe("train.rampup_batch_size=[8,8,64]").train
    assert batches(train, 9) == [8, 8, 8, 16, 16, 24, 32, 32, 32]
    for ramp in ([8, 8, 64], [4, 4, 1000], [16, 8, 300], [8, 24, 50]):
        train = recipe(f"train.rampup_batch_size=[{ramp[0]},{ramp[1]},{ramp[2]}]").train
        for consumed in range(0, 2 * ramp[2], 4):
            assert global_batch_at(train, consumed) == megatron_batch(consumed, *ramp, 32)


def test_a_boundary_on_a_whole_sample_is_not_rounded_down():
    """Megatron's float division puts c = 64 of [8, 8, 64] at 2.9999... increments."""
    train = recipe("train.rampup_batch_size=[8,8,64]", "train.global_batch_size=32").train
    ramp = BatchRamp.of(train)
    assert ramp is not None and ramp.increments == 3
    assert global_batch_at(train, 64) == 32 and global_batch_at(train, 63) == 24


def test_without_a_ramp_every_batch_is_the_global_one():
    assert batches(recipe().train, 3) == [32, 32, 32]


def test_the_ramps_end_and_batch_starts():
    train = recipe("train.rampup_batch_size=[8,8,64]").train
    starts = [0, 8, 16, 24, 40, 56, 80, 112]
    assert BatchRamp.of(train).end() == 80
    for below, start in zip(starts, starts[1:]):
        assert [batch_start_at_or_below(train, s) for s in range(below, start)] == \
            [below] * (start - below)


def test_every_sample_is_trained_once_at_any_dp():
    """The samples consumed are the sum of the batches trained, cut into
    whole micro-batches at every dp the ramp allows."""
    train = recipe("train.rampup_batch_size=[8,8,64]", "train.micro_batch_size=2").train
    for dp in (1, 2, 4):
        consumed, seen = 0, []
        for _ in range(8):
            batch = global_batch_at(train, consumed)
            for rank in range(dp):
                seen += [i for mb in micro_batches(consumed, batch, 2, rank, dp) for i in mb]
            consumed += batch
        assert sorted(seen) == list(range(consumed))
    # A batch passed over is the batch training would have taken there.
    assert skip_past(24, {24: global_batch_at(train, 24)}) == 40


@pytest.mark.parametrize("ramp,more,message,fix", [
    ("[8,8]", [], "three positive integers", "[8, 8, 1024]"),
    ("[8,0,64]", [], "three positive integers", "null for no ramp"),
    ("[32,8,64]", [], "nothing to ramp", "train.rampup_batch_size=null"),
    ("[8,16,64]", [], "24 is not a multiple of INCREMENT 16", "divides 24"),
    ("[4,4,64]", ["parallel.dp=2", "parallel.tp=1", "parallel.pp=1"],
     "multiples of micro_batch_size*dp = 4*2 = 8", "at another dp"),
    ("[4,4,64]", ["parallel.pp=2", "parallel.tp=1", "parallel.dp=1"],
     "1F1B needs at least pp=2 micro-batches per step", "raise START to at least 8"),
    ("[8,4,64]", ["parallel.pp=2", "parallel.vpp=2", "parallel.tp=1", "parallel.dp=1"],
     "multiples of pp*micro_batch_size*dp = 8", "use multiples of 8"),
])
def test_a_ramp_no_step_could_train_is_refused(ramp, more, message, fix):
    with pytest.raises(ConfigError, match="train.rampup_batch_size") as err:
        recipe(f"train.rampup_batch_size={ramp}", *more)
    assert message in str(err.value) and "Fix: " in str(err.value) and fix in str(err.value)


def test_skip_batches_must_start_where_a_ramps_batch_starts():
    with pytest.raises(ConfigError, match="the batch there starts at 24") as err:
        recipe("train.rampup_batch_size=[8,8,64]", "resilience.numerics.skip_batches=[[32,16]]")
    assert "start it at 24 or 40" in str(err.value)
    with pytest.raises(ConfigError, match="not a whole number of global batches"):
        recipe("train.rampup_batch_size=[8,8,64]", "resilience.numerics.skip_batches=[[24,8]]")
    recipe("train.rampup_batch_size=[8,8,64]", "resilience.numerics.skip_batches=[[24,32]]")


def test_a_checkpoint_from_before_the_ramp_key_resumes_and_the_ramp_may_not_change():
    """A saved recipe without the key reads as no ramp; changing the ramp on
    a resume is refused as changing train.global_batch_size is."""
    saved = to_dict(recipe())
    del saved["train"]["rampup_batch_size"]
    assert recipe_changes(saved, to_dict(recipe()), []) == []
    changed = recipe_changes(saved, to_dict(recipe("train.rampup_batch_size=[8,8,64]")), [])
    assert [key for key, _, _ in changed] == ["train.rampup_batch_size"]


def test_a_megatron_export_carries_the_ramp_as_megatrons_parser_gives_it():
    ramped = recipe("train.rampup_batch_size=[8,8,64]")
    assert megatron_args(ramped, 3, 24, torch.float32).rampup_batch_size == ["8", "8", "64"]
    assert megatron_args(recipe(), 3, 96, torch.float32).rampup_batch_size is None
