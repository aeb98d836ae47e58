"""A node's health checks while it waits in the rendezvous
(launch/admission.py): a failure ends the wait with NodeExcluded, which
TorchElastic treats as a signal (it leaves the rendezvous open for the other
nodes); a node admitted after a long wait is checked once more."""
from __future__ import annotations

import signal
import socket
import time

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from megaresil.launch.admission import WAKE_SIGNAL, NodeExcluded, WaitingChecks
from tests.harness.fake_clock import FakeClock


class Checks:
    """A node's checks: fit for the first `fit_for` calls, then not."""
    def __init__(self, fit_for: int):
        self.fit_for, self.calls = fit_for, 0

    def __call__(self):
        self.calls += 1
        return None if self.calls <= self.fit_for else "node n1 failed its health check (...)"


def test_a_check_failing_while_the_node_waits_ends_the_wait():
    checks = Checks(fit_for=2)
    before = signal.getsignal(WAKE_SIGNAL)
    with pytest.raises(NodeExcluded) as raised:
        with WaitingChecks(checks, interval_s=0.01):
            for _ in range(10_000):  # a rendezvous that would wait 10 s
                time.sleep(0.001)
    assert raised.value.line == "node n1 failed its health check (...)"
    assert isinstance(raised.value, SignalException) and raised.value.sigval == signal.SIGTERM
    assert checks.calls == 3  # it stops checking once the node failed
    assert signal.getsignal(WAKE_SIGNAL) == before


def test_a_node_admitted_after_a_long_wait_is_checked_once_more():
    checks = Checks(fit_for=0)
    clock = FakeClock(tick=61.0)  # entered, left: a wait longer than the interval
    with pytest.raises(NodeExcluded):
        with WaitingChecks(checks, interval_s=60.0, clock=clock):
            pass
    assert checks.calls == 1


def test_a_short_wait_runs_no_check_and_a_fit_node_goes_on():
    short, fit = Checks(fit_for=0), Checks(fit_for=1)
    with WaitingChecks(short, interval_s=60.0, clock=FakeClock(tick=5.0)):
        pass
    with WaitingChecks(fit, interval_s=60.0, clock=FakeClock(tick=61.0)):
        pass
    assert (short.calls, fit.calls) == (0, 1)


def test_an_error_in_the_rendezvous_is_not_hidden_by_the_checks():
    with pytest.raises(RuntimeError, match="rendezvous closed"):
        with WaitingChecks(Checks(fit_for=0), interval_s=60.0, clock=FakeClock(tick=99.0)):
            raise RuntimeError("rendezvous closed")


def test_a_check_that_cannot_run_ends_the_wait_with_its_error():
    """It ended the checking thread, silently: the spare waited on unchecked."""
    def undecodable():
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    with pytest.raises(NodeExcluded) as raised:
        with WaitingChecks(undecodable, interval_s=0.01):
            for _ in range(10_000):  # a rendezvous that would wait 10 s
                time.sleep(0.001)
    assert raised.value.line.startswith(f"node {socket.gethostname()}'s health check could not "
                                        "run (UnicodeDecodeError: 'utf-8' codec can't decode")
    assert raised.value.line.endswith("it stops waiting to join")
