"""One node's directory of local shards (docs/local-tier.md has the tree;
runs.py says whose directory it is).

A shard is written under its `.partial` name and renamed into place, then
marked: a step counts only where the owner's shard, or a replica of it, is
committed and passes its checksums. Nothing is written under the global
checkpoint root.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local.replication import OTHER_LAYOUT, Holdings
from megaresil.checkpoint.local.shard import SHARD_FORMAT, Shard
from megaresil.checkpoint.validation import check_meta
from megaresil.safe_files import own_dir

DATA, META = "data.bin", "meta.json"
RANK_DIR = re.compile(r"^rank_(\d{5,})$")
DIR_KEY = "checkpoint.local.dir"  # what the tier's messages tell a user to point elsewhere


def node_dir(root: Path, node: int) -> Path:
    """One node's directory under the local root."""
    return root / f"node_{node}"


def newest_complete_step(root: Path, world: int) -> Optional[int]:
    """The newest local step with a committed shard of every rank (its own
    or a replica) in the node directories visible here: the step a restart
    will try first (checksums are verified then, by every rank)."""
    owners: dict[int, set] = {}
    for node in root.glob("node_*"):
        store = NodeStore(node)
        for step, held in store.held().items():
            owners.setdefault(step, set()).update(
                o for o in held if (store.shard_dir(step, o) / fmt.MARKER).exists())
    return max((s for s, held in owners.items() if held >= set(range(world))), default=None)


def rank_dir_name(rank: int) -> str:
    return f"rank_{rank:05d}"


def filesystem_space(directory: Path) -> tuple[str, int]:
    """The filesystem `directory` is (or will be) on, by host and device,
    and its bytes free to this user."""
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    stats = os.statvfs(existing)
    return f"{socket.gethostname()}:{os.stat(existing).st_dev}", stats.f_bavail * stats.f_frsize


class NodeStore:
    """One node's local directory (see the module docstring). `admit`, when
    given, is asked before each commit, naming it, and raises to refuse it
    (fencing.Fence.check: a rank the job re-formed without commits nothing)."""

    def __init__(self, root: Path, admit: Optional[Callable[[str], None]] = None):
        self.root = root
        self.admit = admit

    def shard_dir(self, step: int, owner: int) -> Path:
        return self.root / fmt.step_dir_name(step) / rank_dir_name(owner)

    def write(self, shard: Shard) -> None:
        final = self.shard_dir(shard.step, shard.owner)
        partial = final.with_name(final.name + ".partial")
        with fmt.naming_write_errors(partial, DIR_KEY):
            for directory in (self.root, final.parent):  # in /dev/shm: anyone may plant a link
                own_dir(directory)
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
            self.write_data(partial / DATA, shard.data)
            digest = fmt.write_json_atomic(partial / META, shard.meta)
            self._admit(f"the local commit of rank {shard.owner}'s step {shard.step}", partial)
            if final.exists():  # the step saved again after a restart: same state
                shutil.rmtree(final)
            partial.rename(final)
            fmt.fsync_path(final.parent)
            fmt.write_marker(final, {META: digest})

    def _admit(self, commit: str, partial: Path) -> None:
        """Before the commit replaces anything: refused, the partial goes
        and a shard the current job committed stays."""
        if self.admit is None:
            return
        try:
            self.admit(commit)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise

    def write_data(self, path: Path, data: torch.Tensor) -> None:
        """A shard's data.bin, durable before its meta.json names it."""
        with open(path, "wb") as f:
            f.write(data.numpy().data)
            f.flush()
            os.fsync(f.fileno())

    def read_meta(self, step: int, owner: int) -> dict:
        directory = self.shard_dir(step, owner)
        if not (directory / fmt.MARKER).exists():
            raise fmt.CheckpointError("its save did not finish (no marker)")
        meta = fmt.read_covered_json(directory, META)
        if not isinstance(meta, dict) or meta.get("format") != SHARD_FORMAT \
                or meta.get("step") != step or meta.get("owner") != owner:
            raise fmt.CheckpointError(f"its {META} is not a local shard of rank {owner} at "
                                      f"step {step}")
        try:
            check_meta(meta)
        except fmt.CheckpointError as err:
            raise fmt.CheckpointError(f"{directory}/{META}: {err}") from None
        return meta

    def read(self, step: int, owner: int) -> Shard:
        meta = self.read_meta(step, owner)
        data = np.fromfile(self.shard_dir(step, owner) / DATA, dtype=np.uint8)
        return Shard(meta, torch.from_numpy(data))

    def held(self) -> dict[int, list[int]]:
        """{step: [owner ranks]} of the shard directories here (not validated)."""
        found: dict[int, list[int]] = {}
        for step_dir in fmt.committed_checkpoints(self.root):
            named = fmt.STEP_DIR.match(step_dir.name)
            assert named is not None  # committed_checkpoints lists step directories only
            step = int(named.group(1))
            try:
                names = [p.name for p in step_dir.iterdir()]
            except FileNotFoundError:
                continue  # retired meanwhile by another rank's retention
            found[step] = sorted(int(m.group(1)) for n in names if (m := RANK_DIR.match(n)))
        return found

    def report(self, layout: dict, world: int, run_id: str) -> Holdings:
        """What this node holds: each shard's problem, or None when it looks
        usable by run `run_id` at this layout (checksums are verified later,
        for the step chosen)."""
        report: Holdings = {}
        for step, owners in self.held().items():
            for owner in owners:
                try:
                    problem = usable(self.read_meta(step, owner), layout, world, run_id)
                except fmt.CheckpointError as err:
                    problem = str(err)
                report.setdefault(step, {})[owner] = problem
        return report

    def remove(self, step: int, owners: list[int]) -> None:
        """Remove `owners`' shards at `step`, and the step once it is empty."""
        for owner in owners:
            for name in (rank_dir_name(owner), rank_dir_name(owner) + ".partial"):
                shutil.rmtree(self.root / fmt.step_dir_name(step) / name, ignore_errors=True)
        try:
            (self.root / fmt.step_dir_name(step)).rmdir()
        except OSError:
            pass  # other ranks' shards are still there (or it is gone)

    def retain(self, keep: int, owner: int, owners: list[int]) -> None:
        """Keep the newest `keep` steps of `owner`'s own shard; older steps
        lose the shards of `owners` (what this rank writes)."""
        steps = [s for s, held in self.held().items() if owner in held]
        for step in sorted(steps, reverse=True)[keep:]:
            self.remove(step, owners)

    def discard_after(self, step: int, owners: list[int]) -> None:
        """Shards of steps after the one resumed from: an abandoned future."""
        for later in [s for s in self.held() if s > step]:
            self.remove(later, owners)

    def clean_partials(self, owners: list[int]) -> None:
        """Remove what saves that died left of `owners`' shards: `.partial`
        directories and shards without their marker, which are never read
        and only fill the node's memory."""
        for step in self.held():
            for owner in owners:
                final = self.shard_dir(step, owner)
                shutil.rmtree(final.with_name(final.name + ".partial"), ignore_errors=True)
                if final.is_dir() and not (final / fmt.MARKER).exists():
                    shutil.rmtree(final, ignore_errors=True)
            self.remove(step, [])  # the step's directory, once nothing is left in it


def usable(meta: dict, layout: dict, world: int, run_id: str) -> Optional[str]:
    """Why a shard with this meta cannot serve run `run_id` at `layout`
    (None: it can). A shard another run saved is never loaded: its recipe
    and its steps are that run's (runs.py keeps runs apart; this holds for a
    shard moved by hand too)."""
    if meta.get("run_id") != run_id:
        return f"saved by another run (run id {meta.get('run_id')}, this run's {run_id})"
    if meta["layout"] != layout or meta["world"] != world:
        return f"{OTHER_LAYOUT} ({describe(meta['layout'])}, now {describe(layout)})"
    return None


def describe(layout: dict) -> str:
    return "x".join(f"{k}{layout.get(k)}" for k in ("tp", "pp", "dp"))
