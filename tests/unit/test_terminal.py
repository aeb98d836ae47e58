"""Issue 47 item 9: long jobs say how far they are. `data prepare` reports
each pass over its inputs (documents, tokens, share read, ETA); where no bar
can be drawn (a log, a pipe, a terminal of 0 columns) plain lines come
instead; a dataset named by its .bin file is answered with its prefix."""
from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios

import pytest

from megaresil.config import ConfigError, LoggingConfig
from megaresil.data import build_datasets
from megaresil.terminal import INTERVAL_ENV, SizedProgress, draws_bars
from megaresil.train.metrics import Console
from tests.harness.fake_clock import FakeClock
from tests.unit.test_data_provenance import indexed, prepared


def test_a_prefix_named_by_its_file_is_answered_with_the_prefix(tmp_path):
    prefix = prepared(tmp_path, "c", "byte")
    with pytest.raises(ConfigError, match=f"Fix: give {prefix} instead of {prefix}.bin"):
        build_datasets(indexed(f"{prefix}.bin"), 300, 0)


def test_prepare_says_how_far_each_pass_is(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(INTERVAL_ENV, "0")
    prepared(tmp_path, "c", "bpe")
    lines = capsys.readouterr().err.splitlines()
    training = [line for line in lines if line.startswith("data prepare: training the BPE")]
    encoding = [line for line in lines
                if line.startswith("data prepare: ") and line not in training]
    assert training and encoding
    assert encoding[-1].startswith("data prepare: 60 documents, ") and " tokens, " in encoding[-1]
    assert "100% of 0.0 MB read, ETA 0 s" in encoding[-1]


def test_a_plain_line_every_interval_with_an_eta_from_the_share_done():
    clock, lines = FakeClock(), []
    progress = SizedProgress("data prepare", 4_000_000, clock=clock, say=lines.append,
                             interval=10, drawn=False)
    progress.update(1_000, documents=1, tokens=90)
    clock.advance(10)
    progress.update(1_000_000, documents=1_200, tokens=300_000)
    clock.advance(5)
    progress.update(2_000_000, documents=2_400, tokens=600_000)
    assert lines == ["data prepare: 1,200 documents, 300,000 tokens, 25% of 4.0 MB read, "
                     "ETA 30 s"]
    clock.advance(5)
    progress.update(2_000_000, documents=2_400, tokens=600_000)
    assert lines[-1].endswith("50% of 4.0 MB read, ETA 20 s")
    unknown = SizedProgress("x", None, clock=clock, say=lines.append, interval=0,
                            drawn=False)
    unknown.update(10, documents=3)
    assert lines[-1] == "x: 3 documents"


@pytest.fixture
def terminal_of_no_width():
    """A new pseudo-terminal: it reports 0 rows and 0 columns until told a size."""
    leader, follower = pty.openpty()
    stream = os.fdopen(follower, "w")
    yield stream, leader
    stream.close()
    os.close(leader)


def test_a_terminal_of_0_columns_draws_no_bar_and_gets_the_plain_lines(terminal_of_no_width,
                                                                       monkeypatch, capsys):
    stream, _ = terminal_of_no_width
    assert stream.isatty() and os.get_terminal_size(stream.fileno()).columns == 0
    assert not draws_bars(stream)
    monkeypatch.setattr(sys, "stderr", stream)
    console = Console(LoggingConfig(progress=True, log_interval=1), total_steps=2, start_step=0)
    console.show({"step": 1, "loss": 2.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0})
    console.close()
    assert capsys.readouterr().out.startswith("step 1/2 | loss 2.5000")
    fcntl.ioctl(stream.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    assert draws_bars(stream)
