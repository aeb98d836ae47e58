"""train.rampup_batch_size through the CLI: a run whose global batch ramps
8 -> 32 by 8 over 64 samples (steps of 8, 8, 8, 16, 16, 24, 32, ...), saved
at step 3 in the middle of the ramp under pipeline parallelism (each step's
1F1B schedule runs that step's micro-batches: 2, 2, 2, 4, 4, 6), and resumed
there at the same layout (bit-identical) and at another dp and pp (as the
resume-across-layout tests: the same losses to the reductions' rounding)."""
import pytest

from megaresil.events import read_metrics

RAMP = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "data.seq_len=32",
        "train.global_batch_size=32", "train.rampup_batch_size=[8,8,64]", "train.steps=6",
        "train.eval_batches=0", "logging.progress=false", "logging.tensorboard=false"]


def steps(run_dir) -> list[tuple[int, int, int, float]]:
    """(step, global batch, tokens consumed after it, loss) of each step row."""
    return [(r["step"], r["global_batch_size"], r["tokens"], r["loss"])
            for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.slow
def test_a_resume_mid_ramp_continues_the_ramp_at_the_same_and_another_layout(cli, tmp_path):
    straight = tmp_path / "straight"
    cli("train", *RAMP, "parallel.pp=2", "parallel.dp=1", "checkpoint.interval=3",
        f"run.dir={straight}")
    expected = steps(straight)
    assert [(s, batch) for s, batch, _, _ in expected] == [(1, 8), (2, 8), (3, 8), (4, 16),
                                                            (5, 16), (6, 24)]
    assert [tokens for _, _, tokens, _ in expected] == [32 * c for c in (8, 16, 24, 40, 56, 80)]
    mid_ramp = f"checkpoint.load={straight / 'checkpoints' / 'step_0000003'}"

    cli("train", *RAMP, "parallel.pp=2", "parallel.dp=1", mid_ramp,
        f"run.dir={tmp_path / 'same'}")
    assert steps(tmp_path / "same") == expected[3:]  # bit-identical

    cli("train", *RAMP, "parallel.pp=1", "parallel.dp=2", mid_ramp,
        f"run.dir={tmp_path / 'dp2'}")
    resumed = steps(tmp_path / "dp2")
    assert [row[:3] for row in resumed] == [row[:3] for row in expected[3:]]
    assert [row[3] for row in resumed] == pytest.approx([row[3] for row in expected[3:]],
                                                        rel=1e-5)
