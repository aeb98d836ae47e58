"""The base of megaresil's own exceptions: each class says what the failure
means for the job, so the restart policy and the command read the class
instead of keeping lists of them. docs/architecture.md ("Errors")."""
from __future__ import annotations

from typing import ClassVar


class MegaresilError(Exception):
    # The command ends with this status when it reports the failure.
    exit_status: ClassVar[int] = 1
    # No restart can cure it (a bad recipe, no usable checkpoint, a full
    # disk): the first rank to meet it stops the whole job, with the reason.
    fatal: ClassVar[bool] = False
    # `megaresil` reports it as one line, `megaresil: error: ...` (its
    # message names the fix), instead of a traceback.
    reported_by_cli: ClassVar[bool] = False


def is_fatal(err: BaseException) -> bool:
    return isinstance(err, MegaresilError) and err.fatal


def restartable(err: BaseException) -> bool:
    """An in-process restart may follow: not fatal, and not the process
    told to end."""
    return not is_fatal(err) and not isinstance(err, (KeyboardInterrupt, SystemExit))
