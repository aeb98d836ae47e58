"""What the launcher says before and as the workers start: the threads each
rank computes with and who chose them (the banner), live replacement that can
only fall back to the checkpoints, and each worker's name by its rank. The
user's path through all three: tests/e2e/test_journey_own_llama.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megaresil.config import load_recipe
from megaresil.launch.checks import replacement_warning
from megaresil.launch.worker import available_cores, choose_threads
from megaresil.train import story

TINY = "recipes/gpt-tiny.yaml"


@pytest.fixture
def no_threads_env(monkeypatch):
    """Neither variable set, and both restored after the test whatever
    choose_threads writes (a set-then-delete is undone as a whole)."""
    for name in ("OMP_NUM_THREADS", story.THREADS_SPLIT_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_launcher_splits_the_cores_and_the_banner_says_so(no_threads_env, monkeypatch):
    monkeypatch.setattr("megaresil.launch.worker.available_cores", lambda: 8)
    assert choose_threads(4) == 2
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)
    assert story.threads() == "2 threads per rank (8 cores over 4 ranks on this node; " \
                              "OMP_NUM_THREADS chooses)"
    assert choose_threads(16) == 1  # a later launch in this process: its own split
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    assert story.threads().startswith("1 thread per rank (8 cores over 16 ranks")


def test_the_cores_available_are_the_affinity_capped_by_a_cgroup_quota(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    cpu_max = tmp_path / "cpu.max"
    assert available_cores(cpu_max) == 6  # no cgroup v2 file: the affinity
    cpu_max.write_text("max 100000\n")
    assert available_cores(cpu_max) == 6
    cpu_max.write_text("250000 100000\n")  # a container's --cpus=2.5
    assert available_cores(cpu_max) == 3
    cpu_max.write_text("1000000 100000\n")  # a quota above the affinity
    assert available_cores(cpu_max) == 6
    cpu_max.write_text("5000 100000\n")
    assert available_cores(cpu_max) == 1


def test_the_users_omp_num_threads_wins_and_is_named(no_threads_env, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(4) == 3
    monkeypatch.setattr("torch.get_num_threads", lambda: 3)
    assert story.threads() == "3 threads per rank (OMP_NUM_THREADS=3)"
    cfg = load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1"])
    assert "; 3 threads per rank (OMP_NUM_THREADS=3); starts at step 0" in story.banner(cfg, 0)


def test_live_replacement_where_no_peer_holds_a_copy_is_said_at_start():
    def warning(*overrides: str):
        return replacement_warning(load_recipe(TINY, ["resilience.replacement.enabled=true",
                                                      *overrides]))

    alone = warning("parallel.dp=1")
    assert alone.startswith("megaresil: warning: resilience.replacement.enabled: at dp=1 no "
                            "data-parallel peer holds a copy of a rank's state")
    assert "resumes from the newest checkpoint" in alone and "Fix: parallel.dp=2" in alone
    assert "one rank's memory only" in warning("parallel.dp=2", "optimizer.distributed=true")
    assert warning("parallel.dp=2") is None
    assert replacement_warning(load_recipe(TINY, ["parallel.dp=1"])) is None  # replacement off


def test_a_worker_is_named_by_its_rank():
    code = ("from megaresil.launch.worker import name_process; name_process(13); "
            "print(open('/proc/self/comm').read().strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "megaresil-r13"
