"""`run.lock`: a second job on a held run directory is refused naming the
holder; a lock whose holder is gone (dead pid here, or another host's lock
without heartbeat) is taken over; a live one, here or elsewhere, is respected."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tests.harness.cli import ROOT
from megaresil.run_lock import (HELD_ENV, LOCK_NAME, TREE_ENV, Holder, RunDirInUse, RunLock,
                                held_by_worker, held_for_workers, launcher_pid, locks_of_run,
                                read_lock)

HOST = socket.gethostname()


def write_lock(run_dir, *, host=HOST, pid, start_time=0.0, job="other-job", age_s=0.0):
    """A lock as another job would have left it, its last heartbeat `age_s` ago."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "start_time": start_time, "job": job,
                                "since": time.time() - age_s - 60}))
    os.utime(path, (time.time() - age_s,) * 2)
    return path


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield psutil.Process(child.pid)
    child.kill()
    child.wait()


def holder_pid(path):
    seen = read_lock(path)
    return seen.holder.pid if seen and seen.holder else None


def wait_until(condition, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_lock_of_a_dead_pid_on_this_host_is_taken_over_and_released(tmp_path, capsys):
    path = write_lock(tmp_path, pid=dead_pid())
    with RunLock(tmp_path, "new-job") as lock:
        assert lock.owner and holder_pid(path) == os.getpid()
        assert read_lock(path).holder.job == "new-job"
    assert not path.exists()
    assert "is stale" in capsys.readouterr().err


def test_reused_pid_is_not_mistaken_for_the_holder(tmp_path):
    """The recorded pid is alive (this process) but started at another time."""
    path = write_lock(tmp_path, pid=os.getpid(), start_time=12345.0)
    with RunLock(tmp_path, "new-job") as lock:
        assert lock.owner and read_lock(path).holder.start_time != 12345.0


def test_live_holder_on_this_host_is_respected(tmp_path, live_process):
    path = write_lock(tmp_path, pid=live_process.pid, start_time=live_process.create_time(),
                      age_s=3600)  # a heartbeat does not matter where the pid can be checked
    with pytest.raises(RunDirInUse) as err:
        RunLock(tmp_path, "new-job").__enter__()
    message = str(err.value)
    assert message.startswith("run.dir:") and f"pid {live_process.pid}" in message
    assert f"host {HOST}" in message and "Fix:" in message and "\n" not in message
    assert holder_pid(path) == live_process.pid


def test_lock_of_another_host_without_heartbeat_is_taken_over(tmp_path):
    path = write_lock(tmp_path, host="elsewhere", pid=4242, age_s=120)
    with RunLock(tmp_path, "new-job", stale_s=30) as lock:
        assert lock.owner and holder_pid(path) == os.getpid()


def test_fresh_lock_of_another_host_is_respected(tmp_path):
    path = write_lock(tmp_path, host="elsewhere", pid=4242, age_s=2)
    with pytest.raises(RunDirInUse, match="host elsewhere, pid 4242.*last heartbeat 2 s ago"):
        RunLock(tmp_path, "new-job", stale_s=30).__enter__()
    assert holder_pid(path) == 4242


def test_holder_heartbeat_keeps_the_lock_fresh(tmp_path):
    path = tmp_path / LOCK_NAME
    with RunLock(tmp_path, "job", heartbeat_s=0.05):
        os.utime(path, (time.time() - 3600,) * 2)
        wait_until(lambda: time.time() - path.stat().st_mtime < 60)


def test_processes_of_one_job_share_the_lock_and_a_mate_keeps_it(tmp_path):
    """Agents of one elastic job: the first holds the lock, the others join;
    when the holder's node is gone, a mate takes the lock over for the job."""
    path = write_lock(tmp_path, host="lost-node", pid=4242, job="job-7", age_s=0)
    with RunLock(tmp_path, "job-7", heartbeat_s=0.05, stale_s=1.0) as mate:
        assert not mate.owner and holder_pid(path) == 4242
        os.utime(path, (time.time() - 10,) * 2)  # the holder's heartbeat stops
        wait_until(lambda: holder_pid(path) == os.getpid())
    assert not path.exists()


def test_joining_process_leaves_the_holders_lock_in_place(tmp_path):
    with RunLock(tmp_path, "job-7") as holder:
        with RunLock(tmp_path, "job-7") as mate:
            assert holder.owner and not mate.owner
        assert holder_pid(tmp_path / LOCK_NAME) == os.getpid()


def test_creation_is_atomic_under_contention(tmp_path):
    """Many jobs start at once on an empty run directory: exactly one wins."""
    outcomes, barrier = [], threading.Barrier(8)

    def start(job):
        lock = RunLock(tmp_path, job)
        barrier.wait()
        try:
            lock._take()
            outcomes.append("owner" if lock.owner else "joined")
        except RunDirInUse:
            outcomes.append("refused")

    threads = [threading.Thread(target=start, args=(f"job-{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["owner"] + ["refused"] * 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]


def test_only_global_rank_0_outside_our_launcher_takes_it(tmp_path, monkeypatch):
    monkeypatch.delenv(HELD_ENV, raising=False)
    assert not isinstance(held_by_worker(tmp_path, 1), RunLock)
    assert not isinstance(held_by_worker(tmp_path, 0), contextlib.nullcontext)
    monkeypatch.setenv(HELD_ENV, str(tmp_path / LOCK_NAME))
    assert not isinstance(held_by_worker(tmp_path, 0), RunLock)


def test_unreadable_lock_is_judged_by_its_age(tmp_path):
    path = tmp_path / LOCK_NAME
    path.write_text("{torn")
    with pytest.raises(RunDirInUse, match="unreadable lock record"):
        RunLock(tmp_path, "job").__enter__()
    os.utime(path, (time.time() - 3600,) * 2)
    with RunLock(tmp_path, "job") as lock:
        assert lock.owner and read_lock(path).holder == lock.me


def test_a_checkpoint_dir_shared_by_two_runs_is_refused_naming_its_holder(tmp_path):
    """Two runs with their own run.dir but one checkpoint.dir (outside both, or
    inside the first run's directory) would resume each other's checkpoints."""
    for shared in (tmp_path / "shared", tmp_path / "a" / "checkpoints"):
        with held_for_workers(tmp_path / "a", "job-a", shared):
            with pytest.raises(RunDirInUse) as err:
                locks_of_run(tmp_path / "b", shared, "job-b").__enter__()
            assert not (tmp_path / "b" / LOCK_NAME).exists()  # b's run.lock released again
        message = str(err.value)
        assert message.startswith(f"checkpoint.dir: {shared} is in use by job job-a")
        assert f"pid {os.getpid()}" in message and "choose another checkpoint.dir" in message
        with locks_of_run(tmp_path / "b", shared, "job-b"):  # free once the first run ended
            assert holder_pid(shared / LOCK_NAME) == os.getpid()


def test_a_dead_holders_processes_keep_its_lock_until_they_end(tmp_path):
    """A launcher killed with kill -9 leaves a lock naming a dead pid; while
    a process it started (a worker, a guardian) still runs, a new job must not
    take over and train beside it."""
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    holder = Holder(HOST, launcher.pid, psutil.Process(launcher.pid).create_time(), "old-job",
                    time.time())
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                              env={**os.environ, TREE_ENV: holder.token()})
    write_lock(tmp_path, pid=holder.pid, start_time=holder.start_time, job="old-job")
    launcher.kill()
    launcher.wait()
    try:
        with pytest.raises(RunDirInUse) as err:
            RunLock(tmp_path, "new-job", orphan_wait_s=0).__enter__()
        assert f"pids {orphan.pid}" in str(err.value) and "job old-job" in str(err.value)
    finally:
        orphan.kill()
        orphan.wait()
    with RunLock(tmp_path, "new-job", orphan_wait_s=0) as lock:
        assert lock.owner


def test_the_launchers_processes_carry_its_holder_token(tmp_path, monkeypatch):
    monkeypatch.delenv(TREE_ENV, raising=False)
    with held_for_workers(tmp_path, "job-3") as lock:
        assert os.environ[TREE_ENV] == lock.me.token()
        assert launcher_pid() == os.getpid()  # whom the workers end with
    assert TREE_ENV not in os.environ


# --- through the CLI -------------------------------------------------------------

SMALL = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "model.num_layers=2",
         "model.hidden_size=64", "model.num_heads=4", "data.source=synthetic", "data.seq_len=32",
         "train.eval_batches=0", "logging.progress=false", "logging.tensorboard=false"]


def train(run_dir, *extra, env=None, **kwargs):
    command = [sys.executable, "-m", "megaresil", "train", "recipes/gpt-tiny.yaml", *SMALL,
               f"run.dir={run_dir}", *extra]
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != HELD_ENV}
    return command, dict(cwd=ROOT, env=env, text=True, **kwargs)


def kill_tree(pid):
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        process.kill()


@pytest.mark.slow
def test_second_job_on_a_held_run_dir_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    command, kwargs = train(run_dir, "train.steps=2",
                            "faults=[{kind: slow, rank: 0, step: 1, seconds: 300}]")
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             **kwargs)
    try:
        wait_until(lambda: first.poll() is not None
                   or holder_pid(run_dir / LOCK_NAME) == first.pid, timeout=120)
        assert first.poll() is None, f"the first job exited {first.returncode}"
        command, kwargs = train(run_dir, "train.steps=2")
        second = subprocess.run(command, capture_output=True, timeout=300, **kwargs)
        # The same job under a torchrun of the user's own: rank 0's worker is refused.
        as_worker = subprocess.run(command, capture_output=True, timeout=300, **{
            **kwargs, "env": {**kwargs["env"], "RANK": "0", "WORLD_SIZE": "1",
                              "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": "29593"}})
        assert first.poll() is None, "the first job ended before it could be contested"
    finally:
        kill_tree(first.pid)
        first.wait()
    for result in (second, as_worker):
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("megaresil: error: run.dir:"), result.stderr
        assert f"pid {first.pid}" in lines[0] and f"host {HOST}" in lines[0] and "Fix:" in lines[0]

    # The first job was killed: its lock is left behind, stale, and the next job takes it over,
    # trains, and leaves no lock behind.
    assert holder_pid(run_dir / LOCK_NAME) == first.pid
    command, kwargs = train(run_dir, "train.steps=1")
    third = subprocess.run(command, capture_output=True, timeout=600, **kwargs)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "is stale" in third.stderr and f"pid {first.pid}" in third.stderr
    assert not (run_dir / LOCK_NAME).exists()


def test_holder_record_names_host_pid_start_time_and_job(tmp_path):
    with RunLock(tmp_path, "job-9"):
        record = json.loads((tmp_path / LOCK_NAME).read_text())
    assert Holder(**record).pid == os.getpid()
    assert record["host"] == HOST and record["job"] == "job-9"
    assert record["start_time"] == psutil.Process().create_time()
