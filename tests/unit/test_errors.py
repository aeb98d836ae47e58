"""What each of megaresil's exceptions means for the job, read from its class
(megaresil/errors.py): fatal (every rank stops), restartable, and what the
command makes of it. The classification equals the lists the restart policy
and the command kept before the classes said it themselves."""
from __future__ import annotations

import argparse

import pytest

from megaresil.checkpoint.format import CheckpointError, WriteFailure
from megaresil.checkpoint.hf.mapping import UnsupportedModel
from megaresil.checkpoint.location import NoValidCheckpoint
from megaresil.cli import run_command
from megaresil.config import ConfigError
from megaresil.errors import MegaresilError, is_fatal, restartable
from megaresil.events import DamagedRecord
from megaresil.fencing import Fenced, FenceDamaged
from megaresil.resilience.faults import InjectedFault
from megaresil.resilience.numerics import PersistentNumericalFault
from megaresil.resilience.replacement import ReplacementFailed
from megaresil.resilience.restart import JobFailed
from megaresil.resilience.watchdog.abort import HangAbort
from megaresil.run_lock import RunDirInUse
from megaresil.train.handover import LiveStateDamaged

# The lists the classes replaced (resilience/restart.py, cli/__init__.py).
OLD_FATAL = (ConfigError, NoValidCheckpoint, CheckpointError, PersistentNumericalFault)
OLD_NOT_RESTARTABLE = (*OLD_FATAL, KeyboardInterrupt, SystemExit)
OLD_CLI_EXIT_2 = (ConfigError,)
OLD_CLI_EXIT_1 = (CheckpointError, NoValidCheckpoint)

CLASSES = [ConfigError, RunDirInUse, FenceDamaged, DamagedRecord, CheckpointError, WriteFailure,
           UnsupportedModel, NoValidCheckpoint, PersistentNumericalFault, LiveStateDamaged,
           ReplacementFailed, InjectedFault, JobFailed, Fenced, HangAbort, KeyboardInterrupt,
           SystemExit, RuntimeError, ValueError, OSError]


def bare(cls: type[BaseException]) -> BaseException:
    """An instance without its constructor's arguments (the class decides)."""
    return cls.__new__(cls)


@pytest.mark.parametrize("cls", CLASSES, ids=[c.__name__ for c in CLASSES])
def test_the_classification_equals_the_old_lists(cls):
    err = bare(cls)
    assert is_fatal(err) == isinstance(err, OLD_FATAL)
    assert restartable(err) == (not isinstance(err, OLD_NOT_RESTARTABLE))
    reported = isinstance(err, (*OLD_CLI_EXIT_2, *OLD_CLI_EXIT_1))
    assert (isinstance(err, MegaresilError) and err.reported_by_cli) == reported
    if reported:
        assert err.exit_status == (2 if isinstance(err, OLD_CLI_EXIT_2) else 1)


def test_todays_exceptions_share_the_base():
    mine = [c for c in CLASSES if c.__module__.startswith("megaresil.")]
    assert [c for c in mine if not issubclass(c, MegaresilError)] == [Fenced, HangAbort]


def command_raising(monkeypatch, err: BaseException) -> None:
    """`megaresil` whose command raises `err` (the parser left out)."""
    def fail(args):
        raise err

    args = argparse.Namespace(func=fail, overrides=[])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args",
                        lambda self, argv: (args, []))


@pytest.mark.parametrize("err,status", [
    (ConfigError("train.steps", "must be positive.", "set it to 1 or more."), 2),
    (bare(RunDirInUse), 2),
    (CheckpointError("step_0000004 is damaged"), 1),
    (NoValidCheckpoint("none of 2 checkpoints loads"), 1),
])
def test_the_command_reports_them_in_one_line_with_their_status(monkeypatch, capsys, err,
                                                                 status):
    command_raising(monkeypatch, err)
    assert run_command(["recipes"]) == status
    assert capsys.readouterr().err == f"megaresil: error: {err}\n"


@pytest.mark.parametrize("err", [JobFailed("stopped"), PersistentNumericalFault("nan"),
                                 LiveStateDamaged("checksums"), RuntimeError("a bug")])
def test_the_command_leaves_the_others_to_their_traceback(monkeypatch, err):
    command_raising(monkeypatch, err)
    with pytest.raises(type(err)):
        run_command(["recipes"])
