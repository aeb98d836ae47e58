"""Issue 27 item 8: a torn last line of a JSON Lines file the run appends to
is ignored with a warning, new lines go after a newline, and corruption in
the middle is still refused: naming the file and the line (issue 46 item
12), and so is a line that is JSON but none of the file's records."""
from __future__ import annotations

import json

import pytest

from megaresil.events import DamagedRecord, EventLog, read_events, read_jsonl, read_metrics


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
    path.write_text('{"step": 1}\n\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(DamagedRecord) as err:
        read_jsonl(path)
    assert str(err.value) == (f"{path} line 3: '{{\"step\": 2, \"lo' is not JSON. Fix: repair or "
                              "delete that line (megaresil only appends to this file; a deleted "
                              "line loses only that record).")


def test_a_bad_last_line_with_its_newline_is_not_torn_but_corrupt(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "lo\n')
    with pytest.raises(DamagedRecord, match=r"metrics.jsonl line 2: .* is not JSON"):
        read_jsonl(path)


@pytest.mark.parametrize("name,line,problem", [
    ("events.jsonl", "[1, 2]", "is not a JSON object"),
    ("events.jsonl", '{"time": 1.0}', 'has no "event" name'),
    ("metrics.jsonl", '{"step": "7", "loss": 1.0, "time": 1.0}', 'without a whole "step"'),
    ("metrics.jsonl", '{"step": 7, "loss": 1.0}', 'without a whole "step" and a "time"'),
    ("metrics.jsonl", '\udcff{"step": 7}', "is not JSON"),
])
def test_a_line_that_is_none_of_the_files_records_is_refused(tmp_path, name, line, problem):
    path = tmp_path / name
    path.write_bytes(b'{"event": "a", "step": 1, "loss": 1.0, "time": 1.0}\n'
                     + line.encode(errors="surrogateescape") + b"\n")
    with pytest.raises(DamagedRecord, match=f"{name} line 2: .*{problem}"):
        read_events(tmp_path) if name == "events.jsonl" else read_metrics(tmp_path)
