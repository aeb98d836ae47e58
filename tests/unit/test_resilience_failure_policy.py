"""The restart policy's table decides what the if-chain it replaced decided,
for every combination of a failure's facts."""
from __future__ import annotations

import itertools
from dataclasses import fields

import pytest

from megaresil.resilience.failure_policy import RULES, Action, Failure, decide


def chain(f: Failure) -> Action:
    """The worker's failure handling before the table, as one function (the
    oracle): re-raise a fenced rank's failure; stop on a fatal error; restart
    only in process, within the limit, with a lost peer only when it can be
    replaced, not while stopping, and when a restart can cure it."""
    if f.fenced:
        return Action.RERAISE
    if f.fatal_first is not None:
        return Action.STOP_JOB
    if f.fatal_announced:
        return Action.STOP_JOB
    if not (f.in_process and f.restart_allowed and (f.replacing or not f.peer_gone)
            and not f.stopping and f.restartable):
        return Action.RERAISE
    return Action.RESTART


FLAGS = [f.name for f in fields(Failure) if f.name != "fatal_first"]


def every_failure():
    for first in (None, {"rank": 0, "error": "ConfigError: x"}):
        for values in itertools.product((False, True), repeat=len(FLAGS)):
            yield Failure(fatal_first=first, **dict(zip(FLAGS, values)))


def test_the_table_decides_as_the_chain_did_for_every_failure():
    failures = list(every_failure())
    assert len(failures) == 2 ** (len(FLAGS) + 1)
    assert [decide(f) for f in failures] == [chain(f) for f in failures]


def test_every_rule_decides_some_failure():
    """No rule is shadowed by the ones above it."""
    first_match = {next(name for name, applies, _ in RULES if applies(f))
                   for f in every_failure()}
    assert first_match == {name for name, _, _ in RULES}


@pytest.mark.parametrize("failure, action", [
    (Failure(), Action.RESTART),
    (Failure(peer_gone=True, replacing=True), Action.RESTART),
    (Failure(peer_gone=True), Action.RERAISE),
    (Failure(restartable=False), Action.RERAISE),
    (Failure(fatal_announced=True, fenced=True), Action.RERAISE),
    (Failure(fatal_announced=True, in_process=False), Action.STOP_JOB),
])
def test_named_cases(failure, action):
    assert decide(failure) is action
