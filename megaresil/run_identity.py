"""A run's identity: a random id drawn once per run directory, by the first
start that needs it, and kept in `RUN_DIR/run_id`.

It tells this run's state from another's where a path cannot: a run
directory deleted and made again at the same path is another run (its id is
new), and so is another run directory that shares a directory with it (the
local checkpoint tier's root). A copy of a run directory carries the id: up
to the copy it is the same run. docs/local-tier.md ("Whose shards") says what
reads it."""
from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path
from typing import Optional

from megaresil.config import ConfigError

RUN_ID_NAME = "run_id"
RUN_ID = re.compile(r"^[0-9a-f]{16}$")


def read_run_id(run_dir: Path) -> Optional[str]:
    """The run directory's id; None before the first start that needs one.
    ConfigError (a recipe-level error: exit 2) when the file holds no id."""
    path = Path(run_dir) / RUN_ID_NAME
    try:  # never through a link planted in its place
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise _unreadable(path, f"cannot be read ({err.strerror})") from None
    try:
        text = os.read(fd, 64).decode(errors="replace").strip()
    except OSError as err:  # a directory in its place
        raise _unreadable(path, f"cannot be read ({err.strerror})") from None
    finally:
        os.close(fd)
    if not RUN_ID.match(text):
        raise _unreadable(path, f"holds {text[:40]!r}, not a run id")
    return text


def run_id(run_dir: Path) -> str:
    """The run directory's id, drawn and kept now if it has none. Ranks may
    race to draw it: each writes a fresh file of its own and hard-links it
    into place, which fails when the name exists, so all read the first."""
    found = read_run_id(run_dir)
    if found is not None:
        return found
    path = Path(run_dir) / RUN_ID_NAME
    path.parent.mkdir(parents=True, exist_ok=True)  # a rank may get here before rank 0 made it
    drawn = path.with_name(f".{RUN_ID_NAME}.{secrets.token_hex(8)}")
    with open(drawn, "x") as f:  # a fresh file: never one planted under its name
        f.write(secrets.token_hex(8) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        with contextlib.suppress(FileExistsError):
            os.link(drawn, path)
    finally:
        drawn.unlink(missing_ok=True)
    found = read_run_id(run_dir)
    assert found is not None  # the link made it, or the rank that won the race did
    return found


def _unreadable(path: Path, problem: str) -> ConfigError:
    return ConfigError("run.dir", f"{path} {problem}: it names the run whose state the local "
                       "checkpoint tier holds.",
                       f"put back the file the run wrote, or remove {path} (the local tier's "
                       "shards of this run are then another run's, left alone; the global "
                       "checkpoints serve).")
