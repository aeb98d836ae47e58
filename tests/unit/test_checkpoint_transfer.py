"""State moves between ranks through one protocol (checkpoint/transfer.py):
live replacement's and the local tier's. Its moves themselves run in
tests/unit/test_train_handover.py (a peer's state, landing in place, damage
named) and tests/unit/test_checkpoint_local_tier.py (replicas and recovery)."""
from __future__ import annotations

import ast

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint import transfer
from tests.harness.cli import ROOT

POINT_TO_POINT = {"exchange", "post", "finish"}  # Collectives' point-to-point calls


def point_to_point_calls(tree: ast.AST) -> list[str]:
    return [f"{node.lineno}: {ast.unparse(node.func)}" for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in POINT_TO_POINT and "coll" in ast.unparse(node.func.value)]


def test_no_module_but_transfer_moves_state_point_to_point():
    offenders = {}
    for path in sorted((ROOT / "megaresil").rglob("*.py")):
        name = str(path.relative_to(ROOT))
        if name != "megaresil/checkpoint/transfer.py":
            calls = point_to_point_calls(ast.parse(path.read_text()))
            if calls:
                offenders[name] = calls
    assert offenders == {}
    assert not (ROOT / "megaresil/checkpoint/local/moves.py").exists()


def records(*keys: str, checksums: bool = False) -> dict:
    recs = [{"key": k, "offset": [0], **({"checksum": "0" * 16} if checksums else {})}
            for k in keys]
    return {"rects": recs}


def test_a_holder_streams_sums_only_for_records_without_theirs():
    assert transfer.streams_sums(records("a", "b"))
    assert not transfer.streams_sums(records("a", "b", checksums=True))


def test_a_damaged_piece_is_named_by_its_record():
    pieces = [torch.arange(4.0), torch.ones(3)]
    sent = transfer.checksum_list(transfer.checksum_bytes(pieces))
    assert sent == [fmt.checksum(p) for p in pieces]
    transfer.check(records("a", "b"), sent, sent, "it arrived from rank 0 damaged")
    with pytest.raises(fmt.CheckpointError, match="it arrived from rank 0 damaged: checksum "
                                                  r"mismatch in b at offset \(0,\)"):
        transfer.check(records("a", "b"), [sent[0], fmt.checksum(torch.zeros(3))], sent,
              "it arrived from rank 0 damaged")


def test_a_meta_crosses_the_wire_unchanged():
    meta = {"step": 6, "rects": [{"key": "model/w", "offset": [0, 0]}], "rank_state": {"x": 1}}
    assert transfer.decode_meta(transfer.encode_meta(meta)) == meta
