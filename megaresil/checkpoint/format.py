"""The on-disk checkpoint format: directory names, the manifest, checksums
and the file steps of the atomic commit protocol.

A checkpoint is `ROOT/step_NNNNNNN/` (`metadata.json`, the backend's files,
`COMMITTED`), written as `step_N.partial-<id>/`, renamed into place once
every rank's data is fsynced and the manifest written, then marked; `latest`
is replaced last. Shards carry xxHash3-64 checksums in the manifest, and the
marker carries the manifest's. Resuming scans the step directories and never
reads `latest`. docs/checkpoints.md ("How it works") has the details.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional

import xxhash

from megaresil.errors import MegaresilError
from megaresil.safe_files import fsync_path, write_atomic

if TYPE_CHECKING:
    import torch

FORMAT_NAME = "megaresil-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "metadata.json"
MARKER = "COMMITTED"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{7,})$")
_FSYNC_THREADS = 16


class CheckpointError(MegaresilError, RuntimeError):
    """A checkpoint that cannot be used, with the reason and (where known) the fix."""

    fatal, reported_by_cli = True, True


# What to do about a failed write, by errno ({dir}: the directory written to;
# {key}: the recipe key that chose where: checkpoint.dir, checkpoint.local.dir).
_WRITE_FIXES: dict[Optional[int], str] = {
    errno.ENOSPC: "free space on the filesystem of {dir} or point {key} elsewhere",
    errno.EDQUOT: "raise the disk quota on {dir} or point {key} elsewhere",
    errno.EFBIG: "raise the file size limit (ulimit -f) or point {key} elsewhere",
    errno.EACCES: "make {dir} writable or point {key} elsewhere",
    errno.EPERM: "make {dir} writable or point {key} elsewhere",
    errno.EROFS: "remount {dir} read-write or point {key} elsewhere",
}


class WriteFailure(CheckpointError):
    """An OSError while saving `path`, in one line: what, where, errno, the
    fix, which names `key`, the recipe key that chose the directory. Nothing
    is committed before every write has succeeded, so the previous
    checkpoint stays valid."""

    def __init__(self, err: OSError, path: Path, key: str = "checkpoint.dir"):
        self.error, self.path, self.key = err, path, key
        code = errno.errorcode.get(err.errno, f"errno {err.errno}") if err.errno else "OSError"
        reason = os.strerror(err.errno) if err.errno else str(err)
        fix = _WRITE_FIXES.get(err.errno, "check {dir} or point {key} elsewhere")
        super().__init__(f"saving a checkpoint failed: {code} ({reason}) writing {path}; "
                         f"{fix.format(dir=path.parent, key=key)}; the previous checkpoint "
                         "stays valid")

    def __reduce__(self):  # pickled by its fields, not by the message __init__ builds
        return WriteFailure, (self.error, self.path, self.key)


@contextlib.contextmanager
def naming_write_errors(path: Path, key: str = "checkpoint.dir") -> Iterator[None]:
    """Turn an OSError raised while writing `path` (or a file it names) into
    a WriteFailure whose fix names `key`; the outermost caller's key wins
    (the local tier's writes go through the same helpers as the global's)."""
    try:
        yield
    except WriteFailure as failure:
        if failure.key == key:
            raise
        raise WriteFailure(failure.error, failure.path, key) from failure.error
    except OSError as err:
        raise WriteFailure(err, Path(err.filename) if err.filename else path, key) from err


# The manifest's dtypes and their item sizes, without torch: reading a
# manifest (`ckpt inspect`, finding a checkpoint) must not import it.
_ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
              "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


def check_dtype(name: Any) -> str:
    if not isinstance(name, str) or name not in _ITEMSIZES:
        raise CheckpointError(f"unsupported dtype {name!r} in the manifest")
    return name


def torch_dtype(name: str) -> torch.dtype:
    import torch  # only where tensors are made: the manifest is read without it

    return getattr(torch, check_dtype(name))


def dtype_name(tensor: torch.Tensor) -> str:
    """The manifest's name of a tensor's dtype (torch_dtype's inverse)."""
    return str(tensor.dtype).removeprefix("torch.")


def region_bytes(shape: list[int], dtype: str) -> int:
    """Bytes of a (sub)tensor of `shape` and the manifest dtype `dtype`."""
    return math.prod(shape) * _ITEMSIZES[check_dtype(dtype)]


def data_bytes(manifest: dict) -> int:
    """Bytes of every shard the manifest lists: what a whole load reads."""
    return sum(region_bytes(shard["shape"], entry["dtype"])
               for entry in manifest["tensors"].values() for shard in entry["shards"])


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (bf16 viewed as int16, which numpy lacks),
    writable in place where the tensor is contiguous. Flat first: a memoryview
    cannot cast a shape with a zero in it (an empty ZeRO-1 row block)."""
    import torch  # loaded already: the caller holds a tensor

    t = tensor.detach().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().data.cast("B")


def checksum(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor))


def fsync_tree(root: Path, only: Optional[set[str]] = None) -> None:
    """fsync every file under `root` (or only those named relative paths) and
    every directory, so renames that follow see durable data. Many at once:
    each fsync waits for a flush of the disk's cache, which concurrent ones
    share (a zarr checkpoint has a directory per tensor)."""
    paths = []
    for dirpath, _, files in os.walk(root):
        paths += [Path(dirpath) / name for name in files
                  if only is None or str((Path(dirpath) / name).relative_to(root)) in only]
        paths.append(Path(dirpath))
    with ThreadPoolExecutor(max_workers=_FSYNC_THREADS, thread_name_prefix="ckpt-fsync") as pool:
        list(pool.map(fsync_path, paths))


def write_json_atomic(path: Path, data: Any) -> str:
    """Write `data` as JSON in one step; returns the xxh3-64 digest of the
    bytes written (what the completion marker holds)."""
    text = json.dumps(data, indent=1)
    write_text_atomic(path, text)
    return xxhash.xxh3_64_hexdigest(text.encode())


def write_json_new(path: Path, data: Any) -> str:
    """Write `data` as JSON to a new file (never through an existing name or
    a link), without fsync: the caller makes it durable. Returns its digest,
    as write_json_atomic does."""
    text = json.dumps(data, indent=1)
    with naming_write_errors(path), open(path, "x", encoding="utf-8") as f:
        f.write(text)
    return xxhash.xxh3_64_hexdigest(text.encode())


def write_marker(directory: Path, digests: dict[str, str]) -> None:
    """The completion marker, last: `ok`, then the digest of each named file
    (the manifest) whose bytes a reader trusts."""
    lines = ["ok"] + [f"{name} xxh3-64 {digest}" for name, digest in sorted(digests.items())]
    write_text_atomic(directory / MARKER, "\n".join(lines) + "\n")


def read_covered_json(directory: Path, name: str) -> Any:
    """The JSON file `name` of a committed directory, after checking its
    bytes against the digest in the completion marker; CheckpointError
    (naming the file) when the marker is missing or damaged, the digest does
    not match or the file does not parse. A bare `ok` marker has no digest."""
    where = f"{directory.name}/{name}"
    try:
        marker = (directory / MARKER).read_bytes().decode("ascii").splitlines()
        raw = (directory / name).read_bytes()
    except FileNotFoundError as err:
        missing = MARKER if err.filename == str(directory / MARKER) else name
        raise CheckpointError(f"{directory.name} has no {missing}"
                              + (": the save did not finish" if missing == MARKER else "")) from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{directory.name}/{MARKER} cannot be read: {err}") from None
    digests = dict(_marker_entry(directory, line) for line in marker[1:])
    if not marker or marker[0] != "ok" or (len(marker) > 1 and name not in digests):
        raise CheckpointError(f"{directory.name}/{MARKER} is damaged (not a completion marker "
                              f"with the digest of {name})")
    if name in digests and xxhash.xxh3_64_hexdigest(raw) != digests[name]:
        raise CheckpointError(f"{where} does not match the digest in its {MARKER}: the file "
                              "was changed or damaged after the save")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{where} does not parse: {err}") from None


def _marker_entry(directory: Path, line: str) -> tuple[str, str]:
    parts = line.split(" ")
    if len(parts) != 3 or parts[1] != "xxh3-64" or not re.fullmatch(r"[0-9a-f]{16}", parts[2]):
        raise CheckpointError(f"{directory.name}/{MARKER} is damaged: {line[:60]!r}")
    return parts[0], parts[2]


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step: a crash leaves the old or the new
    file, and a link planted at `path` (`latest`) is replaced, not followed."""
    with naming_write_errors(path):
        write_atomic(path, text)


def inside(directory: Path, name: str) -> Path:
    """`directory / name`, refusing names from a manifest that would escape it."""
    path = (directory / name).resolve()
    if directory.resolve() not in path.parents and path != directory.resolve():
        raise CheckpointError(f"manifest names a file outside the checkpoint: {name!r}")
    return path


def committed_checkpoints(root: Path) -> list[Path]:
    """Step directories under `root`, newest first (not yet validated)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if p.is_dir() and (m := STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def clean_partials(root: Path) -> list[str]:
    """Remove saves that died: `.partial-` directories and step directories
    without a marker. Returns the names removed."""
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for path in root.iterdir():
        dead = ".partial-" in path.name or (STEP_DIR.match(path.name) and not (path / MARKER).exists())
        if path.is_dir() and dead:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def update_latest(root: Path, name: str) -> None:
    write_text_atomic(root / LATEST, name + "\n")


def iter_shards(manifest: dict) -> Iterator[tuple[str, dict, dict]]:
    """(key, tensor entry, shard entry) over the whole manifest."""
    for key, entry in manifest["tensors"].items():
        for shard in entry["shards"]:
            yield key, entry, shard
