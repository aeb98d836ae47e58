"""The store's ceiling (drills/store_ceiling.py): its summary of the clients'
replies, the rule that ends the climb, and two tiny steps against a real
TCPStore served here, for the shape of the results (no timings)."""
from __future__ import annotations

import pytest

from megaresil.drills.store_ceiling import (
    MIX,
    MULTI_GET_KEYS,
    Step,
    climb,
    percentile,
    stopped_growing,
    summarise,
)


def reply(latency_s: float, calls: int) -> dict:
    """A client's reply: `calls` of each operation, each `latency_s` long."""
    return {"seconds": 2.0, "ops": {op: {"calls": calls, "keys": calls * (
        MULTI_GET_KEYS if op == "multi_get" else 1), "latencies": [latency_s] * calls}
        for op in set(MIX)}}


def test_a_step_is_summed_over_its_clients_per_operation():
    step = summarise(Step(100.0, 2.0), [reply(0.001, 10), reply(0.003, 30)], cpu_s=0.4,
                     wall_s=2.0)
    ops = len(set(MIX))
    assert step["ops_per_s"] == pytest.approx(40 * ops / 2.0)
    assert step["by_op"]["multi_get"]["keys_per_s"] == pytest.approx(40 * MULTI_GET_KEYS / 2)
    assert step["keys_per_s"] == pytest.approx(40 * (ops - 1 + MULTI_GET_KEYS) / 2)
    assert step["store_cpu_s_per_1k_ops"] == pytest.approx(0.4 / (40 * ops) * 1e3)
    # 10 calls of 1 ms and 30 of 3 ms: the median and the 99th are 3 ms.
    assert step["by_op"]["set"]["p50_ms"] == pytest.approx(3.0)
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile([], 0.99) == 0.0


def test_the_climb_ends_when_the_throughput_stops_growing():
    rows = [{"ops_per_s": x} for x in (1000, 2000, 2100)]
    assert not stopped_growing(rows[:1], 1.1) and not stopped_growing(rows[:2], 1.1)
    assert stopped_growing(rows, 1.1)
    assert stopped_growing([{"ops_per_s": 3000}, {"ops_per_s": 1000}], 1.1)


def test_two_tiny_steps_on_a_real_store():
    result = climb(clients=2, first_per_s=100.0, seconds=0.2, max_steps=2)
    assert [s["offered_per_s"] for s in result["steps"]] == [100.0, 200.0]
    assert result["ceiling"] == max(result["steps"], key=lambda s: s["ops_per_s"])
    for step in result["steps"]:
        assert set(step["by_op"]) == set(MIX)
        multi = step["by_op"]["multi_get"]
        assert multi["keys_per_s"] == pytest.approx(multi["ops_per_s"] * MULTI_GET_KEYS)
        assert all(0 <= row["p50_ms"] <= row["p99_ms"] for row in step["by_op"].values())
        assert step["ops_per_s"] > 0 and step["store_cpu_s_per_1k_ops"] >= 0
