"""Device hygiene of saving: the staging copy's protocol (which thread copies,
waits and orders the update) on the CPU, the real streams and events under
`pytest -m gpu`, and every CUDA-touching thread setting its device."""
from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch
import torch.distributed as dist

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint import manager
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.offline.planning import recipe_layout
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.staging import StagingBuffers, StagingCopy
from megaresil.config import RecipeConfig, WatchdogConfig, to_dict
from megaresil.events import EventLog
from megaresil.resilience.watchdog.monitor import Watchdog
from tests.harness.fake_clock import FakeClock

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def state_of(tensor: torch.Tensor) -> tuple[list[Rect], manager.RunRecord]:
    cfg = RecipeConfig()
    state = manager.RunRecord(step=1, layout=recipe_layout(cfg), recipe=to_dict(cfg),
                             consumed_samples=0, optimizer_steps=1)
    return [Rect("model/w", tuple(tensor.shape), (0, 0), tensor)], state


def saved_value(root, like: torch.Tensor) -> torch.Tensor:
    directory = root / "step_0000001"
    target = Rect("model/w", tuple(like.shape), (0, 0), torch.zeros(like.shape, dtype=like.dtype))
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    Checkpointer(root, "zarr", group=None, asynchronous=False, keep=1, events=EventLog(root),
                 device=torch.device("cpu")).load(directory, manifest, [target])
    return target.tensor


def test_async_save_copies_waits_then_orders_the_update(tmp_path, monkeypatch):
    """The copy is made on the save thread, which waits for it on the host
    before writing; the loop's next update orders itself after the copy; and
    what is written is the value at the save call, not the updated one."""
    calls = []

    class Recording(StagingCopy):
        def into(self, targets, sources):
            calls.append(("into", threading.current_thread().name))
            super().into(targets, sources)

        def wait_on_host(self):
            calls.append(("wait_on_host", threading.current_thread().name))

        def order_before_update(self):
            calls.append(("order_before_update", threading.current_thread().name))

    monkeypatch.setattr(manager, "StagingCopy", Recording)
    ckpt = Checkpointer(tmp_path, "zarr", group=None, asynchronous=True, keep=1,
                        events=EventLog(tmp_path), device=torch.device("cpu"))
    write = ckpt.backend.write
    ckpt.backend.write = lambda *args: (calls.append(("write", threading.current_thread().name)),
                                        write(*args))[1]
    tensor = torch.arange(64.0).reshape(8, 8)
    expected = tensor.clone()
    ckpt.save(*state_of(tensor), rank_state={})
    ckpt.before_update()
    tensor.add_(1.0)  # the optimizer step
    ckpt.close()
    loop = threading.current_thread().name
    save_thread = next(name for what, name in calls if what == "into")
    assert save_thread != loop
    assert calls.index(("into", save_thread)) < calls.index(("wait_on_host", save_thread)) \
        < calls.index(("write", save_thread))
    assert ("order_before_update", loop) in calls
    torch.testing.assert_close(saved_value(tmp_path, tensor), expected, rtol=0, atol=0)


def test_staging_host_memory_is_pinned_only_for_gpu_sources():
    cpu = StagingCopy.of([torch.zeros(2)])
    assert not cpu.on_gpu and not cpu.host_empty((4,), torch.bfloat16).is_pinned()
    source = torch.randn(3, 5, dtype=torch.bfloat16)
    (copy,) = cpu.to_host([source])
    assert copy.dtype == torch.bfloat16 and copy.data_ptr() != source.data_ptr()
    torch.testing.assert_close(copy, source, rtol=0, atol=0)


class NeverDone:
    """A CUDA event recorded behind a kernel that never ends."""

    def query(self) -> bool:
        return False


def test_a_copy_that_never_lands_is_given_up_on_after_its_bound():
    clock = FakeClock()
    copy = StagingCopy(torch.device("cpu"))
    assert copy.landed_within(10.0, clock=clock)  # nothing enqueued: landed
    copy.done = NeverDone()
    assert not copy.landed_within(10.0, clock=clock)
    assert 10.0 < clock.now < 10.1


def test_watchdog_thread_works_on_the_trainers_device(tmp_path, monkeypatch):
    """The monitor thread (which aborts NCCL groups) makes the trainer's
    device current first; it would start on GPU 0."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, device)))
    wd = Watchdog(WatchdogConfig(poll_s=0.05), rank=0, world=1, store=dist.HashStore(),
                  run_dir=tmp_path, events=EventLog(tmp_path, 0), exit_on_hang=None,
                  guardian=False, device=torch.device("cuda", 1))
    wd.start()
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.02)
    wd.close()
    assert calls == [("megaresil-watchdog", torch.device("cuda", 1))]


@pytest.mark.gpu
@CUDA
def test_async_save_from_the_gpu_sees_the_last_update_and_not_the_next(tmp_path):
    """The side-stream copy starts after the work queued before the save (a
    long queue of kernels ending in an update) and the next update waits for
    it: the checkpoint holds exactly the value at the save call."""
    device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.randn(4096, 4096, device=device)
    busy = torch.randn(4096, 4096, device=device)
    expected = (tensor * 2).cpu()
    for _ in range(20):  # keep the training stream busy past the save call
        busy = busy @ busy / 4096
    tensor.mul_(2)
    ckpt = Checkpointer(tmp_path, "zarr", group=None, asynchronous=True, keep=1,
                        events=EventLog(tmp_path), device=device)
    ckpt.save(*state_of(tensor), rank_state={})
    ckpt.before_update()
    tensor.add_(1.0)  # the next optimizer step
    ckpt.close()
    torch.testing.assert_close(saved_value(tmp_path, tensor), expected, rtol=0, atol=0)


@pytest.mark.gpu
@CUDA
def test_gpu_staging_uses_pinned_memory_and_its_own_stream():
    device = torch.device("cuda", torch.cuda.current_device())
    # The source exists before the copy records `ready` (the training stream
    # at the save call): the side stream orders only after work queued by then.
    source = torch.arange(1 << 20, device=device, dtype=torch.float32)
    copy = StagingCopy.of([source])
    (host,) = copy.to_host([source])
    assert host.is_pinned() and copy.done is not None
    copy.wait_on_host()
    copy.order_before_update()
    assert torch.equal(host, torch.arange(1 << 20, dtype=torch.float32))


def two_key_state(weights: torch.Tensor, moment: torch.Tensor, step: int):
    _, state = state_of(weights)
    rects = [Rect("model/w", tuple(weights.shape), (0, 0), weights),
             Rect("optim/m", tuple(moment.shape), (0,), moment)]
    return rects, dataclasses.replace(state, step=step)


def test_async_saves_with_the_update_at_once_write_what_sync_saves_do(tmp_path, monkeypatch):
    """The optimizer step comes right after each save call, while a slowed
    staging copy has not started: it waits for the copy, so each async save
    (the second staged into the memory the first kept) holds the bytes a
    synchronous save of the same state holds."""
    staged_into = []

    class Slow(StagingCopy):
        def into(self, targets, sources):
            staged_into.append([t.data_ptr() for t in targets])
            time.sleep(0.2)
            super().into(targets, sources)

    weights = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    moment = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    sync = Checkpointer(tmp_path / "sync", "torch_dist", group=None, asynchronous=False,
                        keep=0, events=EventLog(tmp_path), device=torch.device("cpu"))
    monkeypatch.setattr(manager, "StagingCopy", Slow)
    asynchronous = Checkpointer(tmp_path / "async", "torch_dist", group=None, asynchronous=True,
                                keep=0, events=EventLog(tmp_path), device=torch.device("cpu"))
    for step in (1, 2):
        sync.save(*two_key_state(weights.clone(), moment.clone(), step), rank_state={})
        asynchronous.save(*two_key_state(weights, moment, step), rank_state={})
        asynchronous.before_update()
        weights.mul_(1.5)  # the optimizer step, at once
        moment.add_(1.0)
    sync.close()
    asynchronous.close()
    assert staged_into[1] == staged_into[0]  # the kept memory
    for step in (1, 2):
        name = fmt.step_dir_name(step)
        # The data files (DCP's .metadata holds a save's own id).
        files = sorted(p.relative_to(tmp_path / "sync" / name)
                       for p in (tmp_path / "sync" / name / "dcp").glob("*.distcp"))
        assert files
        for file in files:
            assert (tmp_path / "async" / name / file).read_bytes() == \
                (tmp_path / "sync" / name / file).read_bytes(), file
        tables = [json.loads((tmp_path / kind / name / fmt.MANIFEST).read_text())["tensors"]
                  for kind in ("sync", "async")]
        assert tables[0] == tables[1]  # the checksums included


def test_staging_memory_is_kept_only_for_the_same_shapes():
    buffers, copy = StagingBuffers(), StagingCopy(torch.device("cpu"))
    source = torch.randn(4, 4)
    (first,) = buffers.copy(copy, [source])
    buffers.give_back([first])
    source.add_(1.0)
    (second,) = buffers.copy(copy, [source])
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, source)
    (taken,) = buffers.copy(copy, [source])  # the kept memory is in use (not given back)
    assert taken.data_ptr() != first.data_ptr()
    buffers.give_back([second])
    (other,) = buffers.copy(copy, [torch.zeros(2, 8)])
    assert other.shape == (2, 8) and other.data_ptr() != first.data_ptr()
