"""The on-disk checkpoint format: directory names, manifest, checksums, and the
atomic commit protocol.

    ROOT/
      latest                       name of the newest committed checkpoint (replaced atomically)
      step_0000100/
        metadata.json              the manifest
        <backend files>
        COMMITTED                  completion marker, the last thing written
      step_0000200.partial-<id>/   a save in progress (or one that died): never loaded

A checkpoint is written under its `.partial-` name; only after every rank's
data is fsynced and the manifest written is it renamed into place, then the
marker is written, then `latest` is replaced. A crash at any point leaves the
previous checkpoint and `latest` untouched.

Checksums are xxHash3-64 over each shard's raw bytes: it hashes faster than
disks read, so verifying never costs more than reading the data.
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
from typing import Any, Iterator, Optional

import torch
import xxhash

FORMAT_NAME = "megaresil-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "metadata.json"
MARKER = "COMMITTED"
LATEST = "latest"
STEP_DIR = re.compile(r"^step_(\d{7,})$")
_FSYNC_THREADS = 16


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and (where known) the fix."""


# What to do about a failed write, by errno ({dir}: the directory written to).
_WRITE_FIXES = {
    errno.ENOSPC: "free space on the filesystem of {dir} or point checkpoint.dir elsewhere",
    errno.EDQUOT: "raise the disk quota on {dir} or point checkpoint.dir elsewhere",
    errno.EFBIG: "raise the file size limit (ulimit -f) or point checkpoint.dir elsewhere",
    errno.EACCES: "make {dir} writable or point checkpoint.dir elsewhere",
    errno.EPERM: "make {dir} writable or point checkpoint.dir elsewhere",
    errno.EROFS: "remount {dir} read-write or point checkpoint.dir elsewhere",
}


def write_failure(err: OSError, path: Path) -> CheckpointError:
    """The one-line error for an OSError while saving `path`: what, where,
    errno, the fix. Nothing is committed before every write has succeeded, so
    the previous checkpoint stays valid."""
    code = errno.errorcode.get(err.errno, f"errno {err.errno}") if err.errno else "OSError"
    reason = os.strerror(err.errno) if err.errno else str(err)
    fix = _WRITE_FIXES.get(err.errno, "check {dir} or point checkpoint.dir elsewhere")
    return CheckpointError(f"saving a checkpoint failed: {code} ({reason}) writing {path}; "
                           f"{fix.format(dir=path.parent)}; the previous checkpoint stays valid")


@contextlib.contextmanager
def naming_write_errors(path: Path) -> Iterator[None]:
    """Turn an OSError raised while writing `path` (or a file it names) into
    write_failure's CheckpointError."""
    try:
        yield
    except OSError as err:
        raise write_failure(err, Path(err.filename) if err.filename else path) from err


_DTYPES = {str(d).removeprefix("torch."): d for d in
           (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
            torch.int16, torch.int8, torch.uint8, torch.bool)}


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name!r} in the manifest")
    return _DTYPES[name]


def region_bytes(shape: list[int], dtype_name: str) -> int:
    """Bytes of a (sub)tensor of `shape` and the manifest dtype `dtype_name`."""
    return math.prod(shape) * torch_dtype(dtype_name).itemsize


def step_dir_name(step: int) -> str:
    return f"step_{step:07d}"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (bf16 viewed as int16, which numpy lacks)."""
    t = tensor.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def checksum(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(tensor_bytes(tensor))


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=1))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step: a crash leaves the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    with naming_write_errors(path):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)


def inside(directory: Path, name: str) -> Path:
    """`directory / name`, refusing names from a manifest that would escape it."""
    path = (directory / name).resolve()
    if directory.resolve() not in path.parents and path != directory.resolve():
        raise CheckpointError(f"manifest names a file outside the checkpoint: {name!r}")
    return path


# --- reading --------------------------------------------------------------------


def read_manifest(directory: Path) -> dict:
    """The manifest of a committed checkpoint, or CheckpointError saying why not."""
    if not directory.is_dir():
        raise CheckpointError(f"{directory} does not exist or is not a directory")
    if not (directory / MARKER).exists():
        raise CheckpointError(f"{directory.name} has no completion marker ({MARKER}): the save "
                              "did not finish")
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory.name} has no {MANIFEST}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{directory.name}/{MANIFEST} does not parse: {err}") from None
    if manifest.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{directory.name} is not a {FORMAT_NAME} (format "
                              f"{manifest.get('format')!r})")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{directory.name} has format version {manifest['version']}, newer "
                              f"than this megaresil reads ({FORMAT_VERSION}); upgrade megaresil")
    return manifest


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
    removed = []
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
