"""The coordination store's schema (resilience/coordination.py): the keys
every step writes are the ones the running jobs, agents and tools of
earlier versions read (a golden table), its records read back as written,
and no other module names a key or calls a store operation."""
from __future__ import annotations

import ast
import json
import os

import torch.distributed as dist

from megaresil.resilience.coordination import JobStore, attempt_prefix
from megaresil.worker_env import HELD_ENV, WorkerEnv
from tests.harness.cli import ROOT


class KeyLog(dist.Store):
    """A store in memory that records the keys it is asked about."""

    def __init__(self):
        super().__init__()
        self.inner, self.keys = dist.HashStore(), []

    def set(self, key, value):
        self.keys.append(key)
        self.inner.set(key, value)

    def get(self, key):
        self.keys.append(key)
        return self.inner.get(key)

    def add(self, key, amount):
        self.keys.append(key)
        return self.inner.add(key, amount)

    def check(self, keys):
        self.keys.extend(keys)
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        self.keys.append(key)
        return self.inner.compare_set(key, expected, desired)

    def multi_get(self, keys):
        self.keys.extend(keys)
        return self.inner.multi_get(keys)

    def wait(self, keys, timeout=None):
        self.keys.extend(keys)
        self.inner.wait(keys, timeout)


def keys_of(step) -> list[str]:
    log = KeyLog()
    step(JobStore(log))
    return list(dict.fromkeys(log.keys))


GOLDEN = [  # (what a step does, the keys it touches), as released
    (lambda s: s.enter(3, 1), ["generation", "gen3/pid/1", "gen3/entry/1", "gen3/entered"]),
    (lambda s: s.entered_count(3), ["gen3/entered"]),
    (lambda s: s.give_up_members(3, "why"), ["gen3/members_failed"]),
    (lambda s: s.members_failed(3), ["gen3/members_failed"]),
    (lambda s: s.set_up(3, 1), ["gen3/ready/1"]),
    (lambda s: s.announce_replacement(4242, 4343), ["replaced/4242"]),
    (lambda s: s.publish_heartbeat(2, 5, {"beat": 1}), ["hb/2/5"]),
    (lambda s: s.heartbeats(2, [0, 1]), ["hb/2/0", "hb/2/1"]),
    (lambda s: s.abort(7), ["abort/7"]),
    (lambda s: s.set_abort(7, {"reason": "hang"}), ["abort/7"]),
    (lambda s: s.announce_abort(7, {"reason": "error"}), ["abort/7"]),
    (lambda s: s.claim_hang(7, {"rank": 0}), ["hang/7"]),
    (lambda s: s.claim_suspect(7, "checkpoint", 12, 0), ["suspect/checkpoint/12/7"]),
    (lambda s: s.fence_token(7, lambda: "t0"), ["gen7/fence_token"]),
]


def test_every_key_is_the_one_released():
    for step, golden in GOLDEN:
        assert keys_of(step) == golden


def test_the_replacement_protocol_reads_the_keys_it_wrote():
    def replace(store: JobStore):
        store.enter(0, 1)
        assert store.lost_in_setup(1, os.getpid())
        assert not store.replacement_started(1, 1)
        assert store.generation_to_join(1, 1.0) == 1
    keys = keys_of(replace)
    assert set(keys) == {"generation", "gen0/pid/1", "gen0/entry/1", "gen0/entered", "gen0/ready/1",
                         f"replaced/{os.getpid()}"}


def test_an_attempts_prefix_is_its_round_or_its_restart_count():
    parse = WorkerEnv.parse
    assert attempt_prefix(parse({HELD_ENV: "1", "MASTER_PORT": "29512"})) == "megaresil/round_29512"
    assert attempt_prefix(parse({"TORCHELASTIC_RESTART_COUNT": "2"})) == "megaresil/attempt_2"
    assert attempt_prefix(parse({})) == "megaresil/attempt_0"


def test_records_read_back_as_written():
    store = JobStore(dist.HashStore())
    beat = {"state": "running", "section": "step", "step": 3, "beat": 9, "coll": {}}
    store.publish_heartbeat(0, 1, beat)
    assert store.heartbeat(0, 1) == beat and store.heartbeat(0, 0) is None
    assert store.heartbeats(0, [0, 1]) == {0: None, 1: beat}
    assert store.abort(0) is None and not store.aborted(0)
    first = {"reason": "error", "rank": 1, "error": "ValueError: x"}
    assert store.announce_abort(0, first) == first
    assert store.announce_abort(0, {"reason": "fatal", "rank": 0, "error": "y"}) == first
    assert store.abort(0) == first and store.aborted(0)
    assert store.claim_hang(0, {"rank": 1}) and not store.claim_hang(0, {"rank": 0})
    assert store.claim_suspect(0, "step", 3, 1) and not store.claim_suspect(0, "step", 3, 0)
    assert store.fence_token(4, lambda: "drawn") == store.fence_token(4, None) == "drawn"
    store.enter(2, 0)
    assert store.member_pid(2, 0) is not None and store.member_pid(2, 1) is None
    assert store.newest_generation() == 2 and store.entered_count(2) == 1


def test_a_hang_is_claimed_with_the_bytes_of_its_report():
    # Two ranks declaring the same hang compare the stored bytes with their own.
    store = JobStore(dist.HashStore())
    report = {"rank": 0, "section": "step", "culprit_ranks": [1]}
    assert store.claim_hang(0, report)
    assert json.loads(store.store.get("hang/0")) == report


STORE_OPS = {"set", "get", "add", "check", "compare_set", "wait", "multi_get", "delete_key",
             "num_keys", "set_timeout"}
STORE_TYPES = {"TCPStore", "PrefixStore", "HashStore", "FileStore"}
# compat.py wraps torch's TCPStore for the agent's server (a private torch
# API's home); the simulator's store meter hosts a store and counts what
# passes through it. Both make stores; neither names a key. The ceiling
# bench drives a bare store with the control plane's mix of operations on
# keys of its own, to measure the store, not the control plane.
ALLOWED = {"megaresil/resilience/coordination.py", "megaresil/compat.py",
           "megaresil/drills/store_meter.py", "megaresil/drills/store_ceiling.py"}


def store_uses(tree: ast.AST) -> list[str]:
    """Store operations on a receiver named like a store, and stores made."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        receiver = ast.unparse(node.func.value)
        if node.func.attr in STORE_OPS and "store" in receiver.lower():
            found.append(f"{node.lineno}: {receiver}.{node.func.attr}")
        if node.func.attr in STORE_TYPES:
            found.append(f"{node.lineno}: {receiver}.{node.func.attr}")
    return found


def test_no_module_but_coordination_touches_the_store():
    offenders = {}
    for path in sorted((ROOT / "megaresil").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name not in ALLOWED:
            uses = store_uses(ast.parse(path.read_text()))
            if uses:
                offenders[name] = uses
    assert offenders == {}
