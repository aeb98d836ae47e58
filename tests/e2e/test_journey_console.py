"""Journey of issue 26's console: a second Ctrl-C stops at once, the resume
says what its start-up cost (a checkpoint load with its rate), and the run
is evaluated on both held-out splits, in one process and over two
tensor-parallel ones, and refused for generation where the model would not
fit, without a word written into the run directory."""
import json
import time
from pathlib import Path

import pytest

from tests.harness.journey import (home, interrupt, megaresil, start,  # noqa: F401  (home: a fixture)
                                   user_env, with_demo_corpus)

pytestmark = pytest.mark.journey

# Step 3 computes for a minute: both Ctrl-Cs land inside it, so a run that
# stopped "at once" cannot have waited for the step to end.
COMMAND = ["train", "gpt-tiny", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
           "train.steps=4", "data.seq_len=32", "train.micro_batch_size=2",
           "train.global_batch_size=2", "train.eval_batches=1", "train.eval_interval=0",
           "logging.tensorboard=false", "logging.progress=false", "checkpoint.interval=2",
           "faults=[{kind: slow, rank: 0, step: 3, seconds: 60}]", "run.dir=run"]


def wait_for_step(metrics: Path, step: int, proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(line).get("step", 0) >= step
                                    for line in metrics.read_text().splitlines()):
            return
        time.sleep(0.2)
    raise AssertionError(f"step {step} never came: {proc.communicate()[0][-3000:]}")


def test_second_ctrl_c_stops_at_once_then_resume_eval_and_generate(home, demo_corpus):
    with_demo_corpus(home / ".cache" / "megaresil", demo_corpus)  # as an earlier run left it
    proc = start(*COMMAND, cwd=home)
    wait_for_step(home / "run/metrics.jsonl", 2, proc)
    time.sleep(1.0)  # into step 3's minute
    interrupt(proc)
    time.sleep(1.5)
    interrupt(proc)
    second = time.monotonic()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output[-3000:]
    assert time.monotonic() - second < 30, output[-3000:]  # not the minute step 3 would take
    assert "Traceback" not in output and "hang" not in output, output[-5000:]
    said = [line for line in output.splitlines() if "second Ctrl-C" in line]
    assert len(said) == 1 and "stopped at once without saving" in said[0], output[-3000:]
    assert (home / "run/checkpoints/latest").read_text().strip() == "step_0000002"

    resumed = megaresil(*COMMAND, cwd=home, env=user_env(MEGARESIL_PHASE_LINE_S="0")).stderr
    load = [line for line in resumed.splitlines() if "start-up: checkpoint load took" in line]
    assert len(load) == 1 and load[0].endswith(" GB/s)"), resumed[-3000:]
    assert resumed.count("start-up: data preparation took") == 1  # the launcher's
    assert resumed.count("start-up: rendezvous took") == 1
    assert resumed.count("start-up: data, model and optimizer build took") == 1

    events_before = (home / "run/events.jsonl").read_text()
    written = [json.loads(line) for line in (home / "run/metrics.jsonl").read_text().splitlines()]
    eval_loss = [r["eval_loss"] for r in written if "eval_loss" in r][-1]
    valid = json.loads(megaresil("eval", "run", "--json", cwd=home).stdout.splitlines()[-1])
    test = json.loads(megaresil("eval", "run", "--split", "test", "--json",
                                cwd=home).stdout.splitlines()[-1])
    assert valid["split"] == "valid" and valid["loss"] == eval_loss and valid["step"] == 4
    assert test["split"] == "test" and test["loss"] != valid["loss"]
    # At another layout than one process: two tensor-parallel ranks hold the model.
    spread = json.loads(megaresil("eval", "run", "--tp", "2", "--json",
                                  cwd=home).stdout.splitlines()[-1])
    assert spread["loss"] == pytest.approx(valid["loss"], rel=1e-5)
    greedy = ["generate", "run", "--prompt", "ROMEO:", "--max-new-tokens", "6", "--json"]
    one = json.loads(megaresil(*greedy, cwd=home).stdout.splitlines()[-1])
    two = json.loads(megaresil(*greedy, "--tp", "2", cwd=home).stdout.splitlines()[-1])
    assert two["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 6
    uneven = megaresil("eval", "run", "--tp", "5", cwd=home, check=False)  # 6 heads
    assert uneven.returncode == 2 and "parallel.tp: tp=5 does not divide" in uneven.stderr

    refused = megaresil("generate", "run", "--prompt", "ROMEO:", cwd=home, check=False,
                        env=user_env(MEGARESIL_AVAILABLE_MEMORY_BYTES="1000000"))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    error = [line for line in refused.stderr.splitlines() if line.startswith("megaresil: error:")]
    # gpt-tiny's 2.7M weights at 4 bytes: the model-only load allocates no
    # grad buffer (the 0.02 GB counted before) and no main copy.
    assert len(error) == 1 and "needs about 0.01 GB of the cpu's memory" in error[0], \
        refused.stderr
    assert "0.00 GB free" in error[0] and "Fix:" in error[0]
    assert (home / "run/events.jsonl").read_text() == events_before  # eval wrote nothing there
