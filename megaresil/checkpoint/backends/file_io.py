"""The write and read discipline both backends share: start the disk early,
fsync behind the writer, ask for bytes before they are needed.

Left alone, the kernel holds a checkpoint's pages in memory until the final
fsync (they are far below its dirty thresholds), so the disk idles while the
data is copied in and the CPU idles while it is flushed. posix_fadvise
(DONTNEED) on written pages starts their writeback without waiting for it
(Linux; PostgreSQL flushes its checkpoints this way where sync_file_range,
which Python lacks, is not available), so the two overlap; bench/README.md
has the measured effect. Every helper is a no-op where posix_fadvise does not
exist.
"""
# mypy: ignore-errors
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from megaresil.checkpoint.format import fsync_path, naming_write_errors

PAGE = 4096


def start_writeback(fd: int, start: int, end: int) -> None:
    """Start writing bytes [start, end) of `fd` to disk, without waiting.
    Only the whole pages inside the range are handed over, so a page that a
    neighbouring write (this writer's next one, or another rank's in a shared
    file) still fills is never put under writeback half-written."""
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if last > first and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, first, last - first, os.POSIX_FADV_DONTNEED)


def prefetch(fd: int, ranges: Iterable[tuple[int, int]]) -> None:
    """Ask the kernel to read the (start, length) ranges of `fd` now, so the
    reads that follow find them in memory instead of waiting in turn."""
    if not hasattr(os, "posix_fadvise"):
        return
    for start, length in ranges:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)


def fsync_threads(threads: int) -> ThreadPoolExecutor:
    """Threads for FsyncBehind. A few at once: each fsync waits for a flush
    of the disk's cache, which concurrent ones share."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-fsync")


class FsyncBehind:
    """fsyncs files on `threads` as the writer finishes them (fsync releases
    the GIL), so flushing one file overlaps writing the next, and the last
    flush the caller's checksums. `wait` returns once this writer's files are
    durable and re-raises the first failure, named (a delayed ENOSPC or EIO)."""

    def __init__(self, threads: ThreadPoolExecutor):
        self.threads, self.flushed = threads, []

    def add(self, path: Path) -> None:
        self.flushed.append(self.threads.submit(_fsync_named, path))

    def wait(self) -> None:
        for flushed in self.flushed:
            flushed.result()


def _fsync_named(path: Path) -> None:
    with naming_write_errors(path):
        fsync_path(path)
