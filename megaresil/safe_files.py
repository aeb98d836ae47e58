"""Writing a run's files without following links planted in their place.

Appended files are opened with `O_NOFOLLOW`; replaced files go through a
fresh `O_EXCL` temporary file renamed over the name; the run's directories
are refused when they are links (`own_dir`); `refuse_links` is the
launcher's check before any worker starts. Files under predictable names in
a directory every user may write (/dev/shm) lie in a directory of this
user's own (`private_dir`). Paths a user names (`run.dir`,
`checkpoint.dir`, `report --out`) are trusted as named, links included.
docs/security.md ("Links in run directories") gives the rules."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator

from megaresil.config import ConfigError

# What a run writes in its run directory (checkpoints/ is the default
# checkpoint root): each must be a file or directory of its own, never a link.
RUN_DIR_ENTRIES = ("metrics.jsonl", "events.jsonl", "recipe.yaml", "goodput.json",
                   "stragglers.jsonl", "run.lock", "checkpoints", "report", "hangs", "elastic",
                   "profile", "tb", "wandb_run_id", "mlflow_run_id", "generation",
                   "excluded_nodes", "run_id")
# What a run writes in its checkpoint root, wherever that lies.
CHECKPOINT_ROOT_ENTRIES = ("latest", "run.lock")


class LinkRefused(OSError):
    """A path the run writes is a link: refused, not followed."""

    def __init__(self, path: Path):
        target = os.readlink(path) if os.path.islink(path) else "?"
        self.message = (f"{path} is a link (to {target}): megaresil writes only files of "
                        "its own, never through a link. Fix: remove the link, or choose "
                        "another directory.")
        super().__init__(errno.ELOOP, self.message, str(path))

    def __str__(self) -> str:
        return self.message


# open()'s text modes as os.open flags: read-write, so that an appended
# file's torn last line can be looked at through the same descriptor.
_MODES = {"a": os.O_RDWR | os.O_APPEND, "w": os.O_RDWR | os.O_TRUNC}


def open_fd_nofollow(path: Path, mode: str = "a") -> int:
    """A descriptor of `path` opened as open(path, mode) would ("a" or "w";
    created 0644 when missing); LinkRefused when `path` is a link."""
    try:
        return os.open(path, _MODES[mode] | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise LinkRefused(Path(path)) from None
        raise


def open_append_nofollow(path: Path) -> int:
    """An O_APPEND descriptor of `path`, refusing a link in the file's place."""
    return open_fd_nofollow(path, "a")


def open_nofollow(path: Path, mode: str = "a") -> IO[str]:
    """`open(path, mode)` for mode "a" or "w", refusing a link in the file's place."""
    return os.fdopen(open_fd_nofollow(path, mode), mode)


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace `path` by `data` in one step (a crash leaves the old or the
    new file): `replacing`. A link at `path` is replaced, never written
    through; a directory that is itself a link (other than one the user
    named) is the caller's to refuse with own_dir."""
    with replacing(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[IO[bytes]]:
    """A binary file whose content replaces `path` when the block ends:
    written to a fresh temporary file beside it, fsynced, renamed over it;
    nothing changes when the block raises."""
    path = Path(path)
    f, tmp = fresh_file_beside(path)
    try:
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def fresh_file_beside(path: Path) -> tuple[IO[bytes], Path]:
    """A new file beside `path` (open to write bytes, and its name), for
    what will be renamed over `path`: made under a random name with O_EXCL,
    so never a link planted under a predictable name; 0644, as the run's
    files are (mkstemp makes 0600)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o644)
    return os.fdopen(fd, "wb"), Path(tmp)


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (so a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def own_dir(path: Path) -> Path:
    """`path` as a directory of the run's own (made with its parents when
    missing); LinkRefused when it is a link."""
    path = Path(path)
    if path.is_symlink():
        raise LinkRefused(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user may write in (made 0700 when
    missing): the place for files under predictable names in a directory
    every user may write, where another user could plant a link or a file
    under a name before this user creates it. PermissionError (LinkRefused
    for a link) when what is there is not such a directory."""
    path = Path(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    found = os.lstat(path)
    if stat.S_ISLNK(found.st_mode):
        raise LinkRefused(path)
    if (not stat.S_ISDIR(found.st_mode) or found.st_uid != os.getuid()
            or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise PermissionError(errno.EACCES, f"{path} is not a directory of this user's own that "
                              "only it may write in (another user may have made it)", str(path))
    return path


def links_among(directory: Path, names: Iterable[str]) -> list[str]:
    """'PATH -> TARGET' for each of `names` in `directory` that is a link."""
    found = []
    for name in names:
        path = Path(directory) / name
        if path.is_symlink():
            found.append(f"{path} -> {os.readlink(path)}")
    return found


def refuse_links(run_dir: Path, checkpoint_root: Path, local_roots: Iterable[Path] = ()
                 ) -> None:
    """ConfigError (exit 2) naming every known path of the run that is a link:
    the run directory's files and directories, the checkpoint root's
    `latest`, lock and step directories (a save replaces one of its step, a
    load reads one), and `local_roots`: the local tier's root (with the
    directories above it that the run made, not a user-named one), the run's
    directory in it, and the lock and node directories in each."""
    steps = sorted(p.name for p in Path(checkpoint_root).glob("step_*"))
    found = links_among(run_dir, RUN_DIR_ENTRIES) + links_among(
        checkpoint_root, [*CHECKPOINT_ROOT_ENTRIES, *steps])
    for root in map(Path, local_roots):
        if root.is_symlink():
            found.append(f"{root} -> {os.readlink(root)}")
        elif root.is_dir():
            nodes = sorted(p.name for p in root.glob("node_*"))
            found += links_among(root, ["run.lock", *nodes])
    if found:
        raise ConfigError("run.dir", f"a run writes only files of its own, but these are links: "
                          f"{', '.join(dict.fromkeys(found))}.",
                          "remove the links or choose another run.dir.")
