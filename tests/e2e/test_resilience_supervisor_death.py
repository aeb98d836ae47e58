"""When a supervisor dies: `kill -9` of each kind of process of a job (the
launcher, which is the TorchElastic agent; a worker; a guardian), then the
same command again at once. One job trains at a time (no process of the old
one lives once the new one holds the lock), metrics.jsonl repeats a step only
under a marked restart, and the run ends bit-equal to a fault-free one."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.harness.cli import ROOT
from megaresil.checkpoint.offline.diff import diff_checkpoints
from megaresil.events import read_events, read_metrics
from megaresil.resilience.faults import is_worker
from megaresil.run_lock import HELD_ENV, LOCK_NAME, TREE_ENV, read_lock

STEPS = 8
RECIPE = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=2",
          f"train.steps={STEPS}", "checkpoint.interval=2", "model.num_layers=2",
          "model.hidden_size=64", "model.num_heads=4", "data.source=synthetic", "data.seq_len=32",
          "train.micro_batch_size=2", "train.global_batch_size=4", "train.eval_batches=0",
          "logging.progress=false", "logging.tensorboard=false",
          # From step 4 on, 2 s a step (computing, not changing the math): the
          # job still runs when the same command is given again after a kill.
          # A fault fires once per run directory and slows only its process,
          # so the relaunched generation is slowed again: the old job still
          # runs while the second command starts, however slowly it starts.
          "faults=[{kind: slow, rank: 0, step: 4, seconds: 2},"
          " {kind: slow, rank: 0, step: 5, seconds: 2, generation: 1}]"]


def command(run_dir: Path, *extra: str) -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in (HELD_ENV, TREE_ENV)}
    return ([sys.executable, "-m", "megaresil", "train", *RECIPE, f"run.dir={run_dir}", *extra],
            dict(cwd=ROOT, env=env, text=True))


def steps_done(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir) if "loss" in r), default=0)


def wait_until(condition, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def victim(launcher: psutil.Process, kind: str) -> psutil.Process:
    """The process of that kind in the job's tree (rank 1's, for a worker)."""
    if kind == "launcher":
        return launcher
    workers = sorted((p for p in launcher.children() if is_worker(p)),
                     key=lambda p: p.environ()["RANK"])
    if kind == "worker":
        return workers[-1]
    return next(p for p in workers[-1].children() if "megaresil.resilience.guardian"
                in " ".join(p.cmdline()))


def alive(processes: list[psutil.Process]) -> list[int]:
    pids = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                pids.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


# A parent that starts a child bound to it, prints the child's pid, and waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, time; "
                          "from megaresil.resilience.guardian import die_with_parent; "
                          f"die_with_parent({__import__('os').getpid()}); print('bound', flush=True); "
                          "time.sleep(120)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "bound\\n"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_process_bound_to_its_parent_dies_with_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    child = psutil.Process(int(parent.stdout.readline()))
    parent.kill()
    parent.wait()
    child.wait(timeout=10)  # psutil.TimeoutExpired while it lives on


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The fault-free run: without the slow steps (2 s each from step 4),
    which change no number, only the time a kill has to land in."""
    run_dir = tmp_path_factory.mktemp("reference")
    args, kwargs = command(run_dir)
    args = [a for a in args if not a.startswith("faults=")]
    result = subprocess.run(args, capture_output=True, timeout=600, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["launcher", "worker", "guardian"])
def test_kill_9_of_any_process_then_the_same_command_again(kind, reference, tmp_path):
    run_dir = tmp_path / "run"
    args, kwargs = command(run_dir)
    first = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True, **kwargs)
    try:
        wait_until(lambda: first.poll() is not None or steps_done(run_dir) >= 3)
        assert first.poll() is None, first.stderr.read()[-3000:]
        old_job = tree(first.pid)
        victim(psutil.Process(first.pid), kind).kill()
        # The same command again at once: refused while the old job's launcher
        # lives; otherwise it takes the run over only once no old process lives.
        second = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  **kwargs)
        overlap = []
        while second.poll() is None:
            seen = read_lock(run_dir / LOCK_NAME)
            if seen and seen.holder and seen.holder.pid == second.pid:
                overlap += alive(old_job)
            time.sleep(0.02)
        second_err = second.stderr.read()
        assert not overlap, f"processes of the old job {sorted(set(overlap))} lived on"
        if kind == "launcher":
            assert second.returncode == 0, second_err[-3000:]
        else:
            assert second.returncode == 2 and f"pid {first.pid}" in second_err, second_err
            assert first.wait(timeout=600) == 0, first.stderr.read()[-3000:]
    finally:
        for process in tree(first.pid) if first.poll() is None else []:
            process.kill()
        first.wait()

    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    seen_steps = set()
    for row in rows:
        assert row["step"] not in seen_steps or row.get("restart"), f"step {row['step']} twice"
        seen_steps.add(row["step"])
    assert seen_steps == set(range(1, STEPS + 1))
    final = f"checkpoints/step_{STEPS:07d}"
    assert diff_checkpoints(reference / final, run_dir / final).identical
    if kind == "worker":  # the agent relaunched the workers
        assert [e["kind"] for e in read_events(run_dir) if e["event"] == "restart"] == ["relaunch"]
