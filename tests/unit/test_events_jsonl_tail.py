"""Issue 27 item 8: a torn last line of a JSON Lines file the run appends to
is ignored with a warning, new lines go after a newline, and corruption in
the middle is still refused."""
from __future__ import annotations

import json

import pytest

from megaresil.events import EventLog, read_events, read_jsonl


def test_a_torn_last_line_is_ignored_with_a_warning(tmp_path, capsys):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "b", "ti')
    assert read_events(tmp_path) == [{"event": "a"}]
    assert "torn line" in capsys.readouterr().err


def test_the_writer_starts_a_new_line_after_a_torn_one(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"event": "a"}\n{"event": "b", "ti')
    EventLog(tmp_path).emit("c")
    assert [e["event"] for e in read_events(tmp_path)] == ["a", "c"]
    lines = path.read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "c" and lines[1] == '{"event": "b", "ti'


def test_corruption_in_the_middle_is_refused(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_a_bad_last_line_with_its_newline_is_not_torn_but_corrupt(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)
