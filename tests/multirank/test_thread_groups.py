"""One thread, one process group: every collective on a group is issued by a
single thread, so an async save's thread can never pair its calls with the
training thread's (the async-save/preemption-check deadlock)."""
from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path

from tests.harness.cli import ROOT

COLLECTIVES = ("all_reduce", "barrier", "all_gather_object", "gather_object", "broadcast",
               "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "gather",
               "broadcast_object_list", "scatter_object_list")


def spy_collectives(record: list) -> None:
    """Wrap torch.distributed's collectives to note (thread, group) per call."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def spied(*args, __original=original, __name=name, **kwargs):
            group = kwargs.get("group") or dist.group.WORLD
            record.append((threading.current_thread().name, id(group), __name))
            return __original(*args, **kwargs)

        setattr(dist, name, spied)


def probe(run_dir: str, out: str) -> None:
    """Train with async saves and local saves at every step and the
    preemption check on, stop, resume, train on; write which threads used
    which group."""
    import torch
    import torch.distributed as dist

    from megaresil.launch.worker import trainer_job
    from megaresil.ports import free_port
    from megaresil.config import load_recipe
    from megaresil.resilience.preemption import PreemptionFlag
    from megaresil.resilience.supervision import Supervision

    record: list = []
    spy_collectives(record)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    for steps in (3, 5):
        cfg = load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", [
            "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "data.source=synthetic",
            "data.seq_len=16", "model.max_seq_len=16", "model.num_layers=2",
            "model.hidden_size=32", "model.num_heads=4", "model.vocab_size=128",
            "train.micro_batch_size=2", "train.global_batch_size=4", f"train.steps={steps}",
            "train.eval_batches=0", "logging.progress=false", "logging.tensorboard=false",
            "checkpoint.async=true", "checkpoint.interval=1", f"run.dir={run_dir}",
            "checkpoint.local.enabled=true", "checkpoint.local.interval=1",
            f"checkpoint.local.dir={run_dir}-local"])
        job = trainer_job(cfg, torch.device("cpu"))(Supervision(preemption=PreemptionFlag()))
        job.run()
        job.close()
    threads_of: dict[int, set] = {}
    for thread, group, _ in record:
        threads_of.setdefault(group, set()).add(thread)
    Path(out).write_text(json.dumps({
        "shared": [sorted(t) for t in threads_of.values() if len(t) > 1],
        "threads": sorted({t for t, _, _ in record}), "calls": len(record)}))


def test_every_process_group_is_used_by_one_thread(tmp_path):
    out = tmp_path / "usage.json"
    process = multiprocessing.get_context("spawn").Process(
        target=probe, args=(str(tmp_path / "run"), str(out)))
    process.start()
    process.join(timeout=300)
    assert process.exitcode == 0
    usage = json.loads(out.read_text())
    assert usage["calls"] > 0 and len(usage["threads"]) >= 3, usage  # saves ran on their threads
    assert usage["shared"] == [], f"groups used by more than one thread: {usage['shared']}"
