"""What the run directory's records say about restarts: how many there
were (the generation a restart opens), the relaunches without progress (the
back-off), what ended the previous attempt, and the newest state a restart
resumes from. Read from events.jsonl, metrics.jsonl and the checkpoints,
which outlive every process and node store."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local.store import newest_complete_step
from megaresil.checkpoint.paths import RunPaths
from megaresil.config import RecipeConfig
from megaresil.events import read_events, read_metrics
from megaresil.fencing import fence_of
from megaresil.resilience.incidents import headline, is_abort, lost_process
from megaresil.run_identity import read_run_id


def restarts_recorded(run_dir: Path) -> int:
    """Restarts so far in this run directory: the generation a rank is in."""
    return sum(e["event"] == "restart" for e in read_events(run_dir))


def relaunches_without_progress(run_dir: Path) -> int:
    """Relaunches recorded since the last optimizer step was completed."""
    last_step = max((r["time"] for r in read_metrics(run_dir) if "loss" in r), default=0.0)
    return sum(e["event"] == "restart" and e.get("kind") == "relaunch" and e["time"] > last_step
               for e in read_events(run_dir))


def newest_step(cfg: RecipeConfig, world: int) -> tuple[Optional[int], Optional[str]]:
    """(step, tier) of the newest committed state in either tier, what a
    restart resumes from unless it proves invalid, for the console line; the
    local tier when the two hold the same step (the restart reads it then).
    Without a local tier there is no choice to name: the tier is None."""
    paths = RunPaths.of(cfg)
    committed = fmt.committed_checkpoints(paths.checkpoint_root)
    # committed_checkpoints lists step directories only: the newest one's name matches.
    newest_name = fmt.STEP_DIR.match(committed[0].name) if committed else None
    newest_global = int(newest_name.group(1)) if newest_name else None
    if not paths.local_enabled:
        return newest_global, None
    found = [(newest_global, "global")] if committed else []
    run = read_run_id(paths.run_dir)  # None: the run has no local shards yet
    step = newest_complete_step(paths.local_run_dir(run), world) if run else None
    found += [(step, "local")] if step is not None else []
    return max(found, key=lambda f: (f[0], f[1] == "local"), default=(None, None))


def current_generation(run_dir: Path) -> int:
    """The generation the run directory is in: its restarts recorded, or
    the fence where it is ahead of the events (events.jsonl lost or cut
    short): a generation never starts behind its own fence."""
    return max(restarts_recorded(run_dir), fence_of(run_dir))


def next_generation(run_dir: Path) -> int:
    """The number the next restart of the run directory gets."""
    return current_generation(run_dir) + 1


def last_failure(run_dir: Path) -> str:
    """What ended the previous attempt, from its events: a hang; else a
    process that ended without a report (its agent recorded it: its peers
    saw only their connections close, whatever their errors say); else the
    first error of a worker's own, or a rank fenced out; else a peer's
    report of losing a process or node nobody recorded."""
    since_restart: list[dict] = []
    for event in read_events(run_dir):
        since_restart = [] if event["event"] == "restart" else since_restart + [event]
    hangs = [e for e in since_restart if e["event"] == "hang_detected"]
    if hangs:
        return f"hang on rank(s) {hangs[0].get('culprit_ranks')} in {hangs[0].get('section')}"
    lost = [e for e in since_restart if e["event"] == "process_lost"]
    if lost:
        return lost_process(lost[0])
    errors = [e for e in since_restart if e["event"] == "worker_error" and not is_abort(e)]
    own = [e for e in since_restart if e["event"] == "fenced"
           or e["event"] == "worker_error" and not is_abort(e) and not e.get("lost_peer")]
    if own and own[0]["event"] == "fenced":
        return f"rank {own[0].get('rank')} was fenced: {own[0].get('reason')}"
    if own:
        return f"rank {own[0].get('rank')}: {headline(own[0].get('error', ''))}"
    if errors:
        return (f"a worker process or node was lost without a report (rank "
                f"{errors[0].get('rank')} saw its connection close)")
    return "a worker process ended without a report"
