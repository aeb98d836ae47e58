"""An exclusive lock on a file: one process builds a cache entry, the others wait."""
from __future__ import annotations

import fcntl
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from megaresil.config import ConfigError
from megaresil.safe_files import LinkRefused, open_nofollow


@contextmanager
def exclusive_lock(path: Path, key: str) -> Iterator[None]:
    """Held until the block ends; `key` is the recipe key that sets the directory."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open_nofollow(path)  # opening through a planted link would create its target
    except LinkRefused as err:
        raise ConfigError(key, f"{err.filename} is a link: the caches use only files of "
                          "their own.", f"remove the link, or set {key} to another "
                          "directory.") from None
    except OSError as err:
        raise PermissionError(f"{key}: cannot write in {path.parent} ({err.strerror}). "
                              f"Fix: set {key} to a writable directory.") from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
