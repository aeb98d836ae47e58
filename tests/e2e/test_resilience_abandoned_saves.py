"""A job that fails with saves in flight restarts without waiting on them.

A gloo group's teardown waits for an op still blocked in it, and a save a
failure abandoned blocks in its collectives, when a rank never joins them,
until the checkpoint timeout. If a restart waited on either tier's save
thread, every restart that met a save in flight would take that timeout (an
in-process restart did, for the local tier: 306 s in a soak, before its group
was detached)."""
from __future__ import annotations

import json

import pytest

from megaresil.events import read_events
from megaresil.fencing import fence_of

# resilience.watchdog.checkpoint_timeout_s: what a stalled restart waits. A
# relaunch on a busy 2-core machine takes up to ~40 s; half of this is the bound.
TIMEOUT_S = 120


@pytest.mark.slow
def test_failures_mid_save_restart_without_waiting_out_either_tiers_save(cli, tmp_path):
    # Rank 3 fails as it enters the checkpoint section of a global save step:
    # its peers' global save (async) and local save (every step) are then
    # blocked in collectives it never joins; 4 ranks, so some of them wait
    # on live peers, not only on the failed one. First it raises (an
    # in-process restart), then it is killed (the launcher relaunches).
    faults = [{"kind": "raise", "rank": 3, "step": 4, "section": "checkpoint"},
              {"kind": "kill", "rank": 3, "step": 6, "section": "checkpoint"}]
    cli("train", "recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=4",
        "train.steps=7", "train.eval_batches=0", "logging.tensorboard=false",
        "data.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=4",
        "checkpoint.interval=2", "checkpoint.async=true", "checkpoint.local.enabled=true",
        "checkpoint.local.interval=1", "checkpoint.local.ranks_per_node=2",
        f"checkpoint.local.dir={tmp_path / 'local'}", "resilience.in_process=true",
        f"resilience.watchdog.checkpoint_timeout_s={TIMEOUT_S}", f"faults={json.dumps(faults)}",
        f"run.dir={tmp_path / 'run'}", "logging.progress=false", timeout=600)
    events = read_events(tmp_path / "run")
    assert [e["kind"] for e in events if e["event"] == "restart"] == ["in_process", "relaunch"]
    starts = [e["time"] for e in events if e["event"] == "generation_started"]
    for fault in (e for e in events if e["event"] == "fault_injected"):
        restarted = min(t for t in starts if t > fault["time"])
        assert restarted - fault["time"] < TIMEOUT_S / 2, \
            f"the restart after {fault['fault']} waited on a save the failure abandoned"
    # Nothing the abandoned saves left behind was chosen: each resume is from
    # a step every rank committed, in either tier.
    loads = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert [e["tier"] for e in loads] == ["local", "local"] and loads[1]["step"] >= 4, loads
    assert any(e["event"] == "run_finished" for e in events)
    # Each restart raised the fence before its generation formed, and no
    # rank of the job was behind it.
    assert fence_of(tmp_path / "run") == 2
    assert not any(e["event"] == "fenced" for e in events)
