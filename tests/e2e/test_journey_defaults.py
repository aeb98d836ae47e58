"""Journeys of issue 26's defaults: a default run leaves a checkpoint, Ctrl-C
saves and the same command resumes bit-equal, a resume at another layout."""
import json
import time
from pathlib import Path

import pytest

from tests.harness.cli import ROOT
from tests.harness.journey import (home, interrupt, megaresil, start,  # noqa: F401  (home: a fixture)
                                   with_demo_corpus)

RECIPE = str(ROOT / "recipes" / "gpt-tiny.yaml")
SMALL = ["parallel.tp=1", "parallel.pp=1", "data.seq_len=64", "train.micro_batch_size=4",
         "train.global_batch_size=8", "train.eval_batches=0", "logging.tensorboard=false",
         "logging.progress=false"]

pytestmark = pytest.mark.journey


@pytest.fixture(scope="module")
def cache(tmp_path_factory, demo_corpus) -> str:
    """One tokenizer cache for the module's runs (each would train the same
    BPE), holding the session's prepared demo corpus."""
    return f"data.cache_dir={with_demo_corpus(tmp_path_factory.mktemp('cache'), demo_corpus)}"


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last record of each step (a resumed run repeats none here)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_a_default_run_saves_its_last_step(home, cache):
    result = megaresil("train", RECIPE, *SMALL, "parallel.dp=1", "train.steps=6", cache,
                       "run.dir=run", cwd=home)
    assert (home / "run/checkpoints/latest").read_text().strip() == "step_0000006"
    chosen = [e for e in events(home / "run") if e["event"] == "checkpoint_interval"]
    assert chosen and chosen[0]["step"] == 4  # the measuring save after calibration
    assert "checkpoint every" in result.stderr and "Young/Daly" in result.stderr
    assert "checkpoint saved: step 6" in result.stderr
    # The story: a banner before the steps, a summary naming the last checkpoint.
    assert result.stderr.count("megaresil: training tp=1 pp=1 dp=1") == 1
    assert "checkpoints auto" in result.stderr
    done = [line for line in result.stderr.splitlines() if line.startswith("megaresil: done:")]
    assert len(done) == 1 and done[0].endswith("run/checkpoints/step_0000006"), result.stderr
    # The same command again: the run is finished, so no worker starts and
    # nothing in the run directory changes (its goodput was rewritten).
    before = {p.name: p.read_bytes() for p in (home / "run").iterdir() if p.is_file()}
    again = megaresil("train", RECIPE, *SMALL, "parallel.dp=1", "train.steps=6", cache,
                      "run.dir=run", cwd=home).stderr.splitlines()
    assert len(again) == 1 and again[0].startswith("megaresil: run is finished: "), again
    assert {p.name: p.read_bytes() for p in (home / "run").iterdir() if p.is_file()} == before


def test_interval_zero_saves_nothing_and_says_so(home, cache):
    result = megaresil("train", RECIPE, *SMALL, "parallel.dp=1", "train.steps=3", cache,
                       "checkpoint.interval=0", "run.dir=run", cwd=home)
    assert result.stderr.count("warning: checkpoint.interval=0") == 1
    assert not (home / "run/checkpoints/latest").exists()


def wait_for_step(run_dir: Path, step: int, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(s >= step for s in losses(run_dir)):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never came: {proc.communicate()[0][-3000:]}")


def test_ctrl_c_saves_and_the_same_command_resumes_bit_equal(home, cache):
    command = ["train", RECIPE, *SMALL, "parallel.dp=2", "train.steps=16", cache, "run.dir=run"]
    proc = start(*command, cwd=home)
    wait_for_step(home / "run", 6, proc)
    interrupt(proc)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    assert output.count("Traceback") == 0, output[-5000:]
    assert "hang" not in output and "forcefully" not in output, output[-3000:]
    said = [line for line in output.splitlines() if "interrupted: saved step" in line]
    assert len(said) == 1 and said[0].endswith("resume with the same command"), output[-3000:]
    stopped = [e for e in events(home / "run") if e["event"] == "interrupted"]
    assert len(stopped) == 1 and stopped[0]["step"] < 16
    assert (home / "run/checkpoints/latest").read_text().strip() == \
        f"step_{stopped[0]['step']:07d}"

    megaresil(*command, cwd=home)
    megaresil(*command[:-1], "run.dir=reference", cwd=home)
    assert losses(home / "run") == losses(home / "reference")


def test_a_run_resumes_at_another_layout(home, cache):
    megaresil("train", RECIPE, *SMALL, "parallel.dp=2", "train.steps=8", "train.exit_at_step=4",
              cache, "run.dir=run", cwd=home)
    # Resumed as the recipe's own default shape has it: a pipeline (only its
    # last stage knows the loss the end summary names).
    result = megaresil("train", RECIPE, *SMALL, "parallel.pp=2", "parallel.dp=1",
                       "train.steps=8", cache, "run.dir=run", cwd=home)
    loaded = [e for e in events(home / "run") if e["event"] == "checkpoint_loaded"]
    assert loaded[-1]["step"] == 4
    assert loaded[-1]["saved_layout"]["dp"] == 2 and loaded[-1]["layout"]["dp"] == 1
    assert loaded[-1]["layout"]["pp"] == 2
    assert sorted(losses(home / "run")) == list(range(1, 9))
    assert (home / "run/checkpoints/latest").read_text().strip() == "step_0000008"
    done = [line for line in result.stderr.splitlines() if line.startswith("megaresil: done:")]
    assert len(done) == 1 and f"final loss {losses(home / 'run')[8]:.4f};" in done[0], done
