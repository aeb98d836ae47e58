"""bench/moe_throughput.py's theory of the bytes expert parallelism sends:
worked values, not the formula again."""
from __future__ import annotations

import sys

from tests.harness.cli import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from moe_throughput import a2a_bytes_per_step  # bench/ is not a package


def test_all_to_all_bytes_of_moe_tiny_at_ep2():
    """moe-tiny at dp2 ep2: 512 tokens a micro-batch, top-2, hidden 128 in
    fp32 (512 bytes a row), 3 expert layers, 2 micro-batches a rank. 1024
    rows a micro-batch and layer, half of them to the peer: 512 rows, 256 KiB,
    4 times (dispatch and combine, forward and backward), 6 layer-micro-batches:
    6 MiB."""
    assert a2a_bytes_per_step(512, 2, 128, 4, 3, 2, ep=2) == 6 * 2**20


def test_nothing_crosses_at_ep1_and_three_quarters_at_ep4():
    assert a2a_bytes_per_step(512, 2, 128, 4, 3, 2, ep=1) == 0
    assert a2a_bytes_per_step(512, 2, 128, 4, 3, 2, ep=4) == 1.5 * \
        a2a_bytes_per_step(512, 2, 128, 4, 3, 2, ep=2)
