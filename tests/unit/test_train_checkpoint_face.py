"""The trainer's one checkpoint face (train/checkpointing.py): it holds the
global and the local tier as peers and calls them in a fixed order, checked
here against fake tiers that record each call."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megaresil.train import checkpointing
from megaresil.train.checkpointing import TrainCheckpointing

STATE = object()  # what the face saves; the fakes only pass it on


class FakeTier:
    """Records `name.method` (and its arguments, if any) into the shared `calls`."""

    def __init__(self, name: str, calls: list, due: bool = False):
        self.name, self.calls, self.is_due = name, calls, due
        self.root = Path(f"/{name}")

    def _record(self, method: str, *args) -> None:
        self.calls.append((f"{self.name}.{method}", *args))

    def before_update(self): self._record("before_update")
    def wait(self): self._record("wait")
    def close(self): self._record("close")
    def abandon(self): self._record("abandon")
    def remove_all(self): self._record("remove_all")
    def save_training(self, state): self._record("save_training", state)
    def save(self, state, step): self._record("save", state, step)

    def due(self, step):
        self._record("due", step)
        return self.is_due


def face(calls: list, local: bool = True, interval: int = 2, due: bool = False):
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(interval=interval))
    return TrainCheckpointing(cfg, FakeTier("global", calls),
                              FakeTier("local", calls, due) if local else None, STATE,
                              events=None, rank=0, job_started=0.0)


@pytest.mark.parametrize(("method", "order"), [
    ("before_update", ["local.before_update", "global.before_update"]),
    ("close", ["local.close", "global.close"]),
    ("abandon", ["global.abandon", "local.abandon"]),
    ("wait", ["global.wait", "local.wait"]),
])
def test_both_tiers_are_called_in_their_order(method, order):
    calls: list = []
    getattr(face(calls), method)()
    assert [c[0] for c in calls] == order


@pytest.mark.parametrize("method", ["before_update", "close", "abandon", "wait"])
def test_without_a_local_tier_only_the_global_tier_is_called(method):
    calls: list = []
    getattr(face(calls, local=False), method)()
    assert [c[0] for c in calls] == [f"global.{method}"]


def test_saves_go_to_their_tier_with_the_trainers_state():
    calls: list = []
    checkpoints = face(calls, due=True)
    checkpoints.save()
    assert checkpoints.local_due(7)
    checkpoints.save_local(7)
    assert calls == [("global.save_training", STATE), ("local.due", 7),
                     ("local.save", STATE, 7)]
    assert checkpoints.root == Path("/global")


def test_no_local_tier_is_never_due():
    calls: list = []
    assert not face(calls, local=False).local_due(3)
    assert calls == []


@pytest.mark.parametrize(("interval", "released"), [(2, True), (0, False)])
def test_finishing_releases_the_local_shards_only_after_a_final_global_save(interval, released):
    calls: list = []
    face(calls, interval=interval).finish()
    assert calls == ([("local.remove_all",)] if released else [])


def test_build_gives_the_global_tier_the_first_group_and_the_local_tier_the_second(
        monkeypatch, tmp_path):
    groups = iter(["first", "second"])
    monkeypatch.setattr(checkpointing, "checkpoint_group", lambda cfg, watchdog: next(groups))
    monkeypatch.setattr(checkpointing, "build_local_tier",
                        lambda cfg, paths, events, group, device, fence, local_world: ("local", group))
    monkeypatch.setattr(checkpointing, "Checkpointer",
                        lambda root, backend, *, group, **kw: ("global", root, group))
    cfg = SimpleNamespace(
        run=SimpleNamespace(dir=str(tmp_path)),
        checkpoint=SimpleNamespace(dir=None, backend=SimpleNamespace(value="zarr"), async_=False,
                                   keep=1, local=SimpleNamespace(enabled=True, dir=None)))
    built = TrainCheckpointing.build(cfg, STATE, None, watchdog=None, device=None, fence=None,
                                     rank=0, job_started=0.0)
    assert built.global_tier == ("global", tmp_path / "checkpoints", "first")
    assert built.local_tier == ("local", "second")
