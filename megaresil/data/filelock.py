"""An exclusive lock on a file: one process builds a cache entry, the others wait."""
from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def exclusive_lock(path: Path, key: str) -> Iterator[None]:
    """Held until the block ends; `key` is the recipe key that sets the directory."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError as err:
        raise PermissionError(f"{key}: cannot write in {path.parent} ({err.strerror}). "
                              f"Fix: set {key} to a writable directory.") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
