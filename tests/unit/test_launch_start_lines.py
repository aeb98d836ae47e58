"""What the launcher says as the workers start: the threads each rank
computes with and who chose them (the banner)."""
from __future__ import annotations

import pytest

from megaresil.config import load_recipe
from megaresil.launch.worker import choose_threads
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
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert choose_threads(4) == 2
    monkeypatch.setattr("torch.get_num_threads", lambda: 2)
    assert story.threads() == "2 threads per rank (8 cores over 4 ranks on this node; " \
                              "OMP_NUM_THREADS chooses)"
    assert choose_threads(16) == 1  # a later launch in this process: its own split
    monkeypatch.setattr("torch.get_num_threads", lambda: 1)
    assert story.threads().startswith("1 thread per rank (8 cores over 16 ranks")


def test_the_users_omp_num_threads_wins_and_is_named(no_threads_env, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert choose_threads(4) == 3
    monkeypatch.setattr("torch.get_num_threads", lambda: 3)
    assert story.threads() == "3 threads per rank (OMP_NUM_THREADS=3)"
    cfg = load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1"])
    assert "; 3 threads per rank (OMP_NUM_THREADS=3); starts at step 0" in story.banner(cfg, 0)

