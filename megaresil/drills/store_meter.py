"""A store that counts: every operation the control plane makes on a real
c10d TCPStore, tallied by operation and key pattern (digits as N: `hb/N/N`),
with the keys and bytes it moves, for the control-plane simulator
(drills/control_plane.py). It names no key of its own: JobStore's calls
pass through it to the wrapped client."""
from __future__ import annotations

import re
import threading
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

DIGITS = re.compile(r"[0-9]+")


def key_pattern(key: str) -> str:
    return DIGITS.sub("N", key)


def _size(value) -> int:
    return len(value) if isinstance(value, (bytes, str)) else 8


class Tally:
    """Counts shared by every counting client of one simulation: per
    (operation, key pattern), the calls, the keys they name and the bytes
    moved (keys, values sent and values returned; no framing)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: Counter = Counter()
        self.keys: Counter = Counter()
        self.bytes: Counter = Counter()

    def note(self, op: str, keys: list[str], sent: int, received: int) -> None:
        pattern = key_pattern(keys[0]) if keys else ""
        with self.lock:
            self.calls[op, pattern] += 1
            self.keys[op, pattern] += len(keys)
            self.bytes[op, pattern] += sum(map(len, keys)) + sent + received

    def snapshot(self) -> dict:
        with self.lock:
            return {"calls": Counter(self.calls), "keys": Counter(self.keys),
                    "bytes": Counter(self.bytes)}


class CountingStore(dist.Store):
    """A store client that forwards to `inner` (a TCPStore client) and
    notes each operation in `tally`."""

    def __init__(self, inner: dist.Store, tally: Tally):
        super().__init__()
        self.inner, self.tally = inner, tally

    def set(self, key, value):
        self.inner.set(key, value)
        self.tally.note("set", [key], _size(value), 0)

    def get(self, key):
        value = self.inner.get(key)
        self.tally.note("get", [key], 0, _size(value))
        return value

    def add(self, key, amount):
        value = self.inner.add(key, amount)
        self.tally.note("add", [key], 8, 8)
        return value

    def check(self, keys):
        found = self.inner.check(keys)
        self.tally.note("check", list(keys), 0, 1)
        return found

    def multi_get(self, keys):
        values = self.inner.multi_get(keys)
        self.tally.note("multi_get", list(keys), 0, sum(map(_size, values)))
        return values

    def compare_set(self, key, expected, desired):
        value = self.inner.compare_set(key, expected, desired)
        self.tally.note("compare_set", [key], _size(expected) + _size(desired), _size(value))
        return value

    def wait(self, keys, timeout=None):
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)
        self.tally.note("wait", list(keys), 0, 0)


def serve() -> dist.TCPStore:
    """A TCPStore server on loopback, on a free port, in this process (its
    own threads answer: the libuv server)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=60))


def client(server: dist.TCPStore, tally: Tally) -> CountingStore:
    """A counting client of `server` on a connection of its own."""
    inner = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                          timeout=timedelta(seconds=60))
    return CountingStore(inner, tally)
