"""Whose local shards are whose: the local root (checkpoint.local.dir, or
its default in /dev/shm) holds one directory per run, named by the run's id
(megaresil/run_identity.py), and a run loads, lists and retires only its
own. The root outlives run directories and may be shared by several, so
the path alone cannot say whose a shard is: a run directory deleted and
made again at the same path is another run, with another id. The other
runs' directories are left as they are, and the launcher says so. One job
at a time holds the root (run_lock, as for the checkpoint root).
docs/local-tier.md ("Whose shards") says it for users."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local.store import NodeStore
from megaresil.checkpoint.paths import RunPaths, run_local_dir
from megaresil.config import RecipeConfig
from megaresil.run_identity import RUN_ID_NAME, read_run_id

RUN_LOCAL_DIR = re.compile(r"^run-([0-9a-f]+)$")
# A node directory right under the root: shards of a version before run ids.
UNNAMED_RUN = re.compile(r"^node_\d+$")


def link_checked(paths: RunPaths) -> list[Path]:
    """The local tier's directories the launcher refuses as links (with the
    node directories in each): the root, the `megaresil` directory above a
    default root (world-writable /dev/shm), and the run's own directory."""
    root = paths.local_root
    checked = [root.parent, root] if paths.local_default else [root]
    if not (paths.run_dir / RUN_ID_NAME).is_symlink():  # one the check names
        run = read_run_id(paths.run_dir)
        checked += [paths.local_run_dir(run)] if run else []
    return checked


def other_runs(root: Path, run_id: Optional[str]) -> list[Path]:
    """The directories of `root` holding other runs' shards (every run's
    when `run_id` is None: the run has drawn none yet, so it has none)."""
    if not root.is_dir():
        return []
    mine = run_local_dir(root, run_id).name if run_id else None
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name != mine
                  and (RUN_LOCAL_DIR.match(p.name) or UNNAMED_RUN.match(p.name)))


def other_runs_line(cfg: RecipeConfig) -> Optional[str]:
    """The launcher's line when the local root holds other runs' shards."""
    paths = RunPaths.of(cfg)
    if not paths.local_enabled:
        return None
    root = paths.local_root
    others = other_runs(root, read_run_id(paths.run_dir))
    if not others:
        return None
    return (f"megaresil: {root} holds the local shards of another run "
            f"({', '.join(p.name for p in others)}): this run neither loads nor removes them; "
            f"delete them (rm -r {others[0]}{' ...' if len(others) > 1 else ''}) once that run "
            "no longer needs them")


def newest_local_shard(cfg: RecipeConfig) -> Optional[tuple[Path, dict]]:
    """The newest shard of this run that a resume could take from the local
    tier here (by its meta: checksums are verified by the workers), for the
    recipe check; None when the tier is not consulted or holds nothing."""
    paths = RunPaths.of(cfg)
    run = read_run_id(paths.run_dir)
    if not paths.local_enabled or cfg.checkpoint.load != "auto" or run is None:
        return None
    held = [(step, owner, store)
            for store in map(NodeStore, paths.local_run_dir(run).glob("node_*"))
            for step, owners in store.held().items() for owner in owners]
    for step, owner, store in sorted(held, key=lambda h: (h[0], -h[1]), reverse=True):
        try:
            meta = store.read_meta(step, owner)
        except fmt.CheckpointError:
            continue  # the workers pass it over too, and say so
        if meta.get("run_id") == run:
            return store.shard_dir(step, owner), meta
    return None
