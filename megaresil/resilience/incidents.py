"""One console line per incident, read from the run's events.jsonl.

The launcher follows the events its workers write (a thread polling the
file from where it stood at launch) and prints what happened, where, and
what happens next, instead of TorchElastic's tracebacks. Events are the
single record: the console says nothing the run directory does not.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, TextIO

from megaresil.observe import startup


def _where(e: dict) -> str:
    return f"in {e.get('section', '?')} at step {e.get('step', '?')}"


def _hang(e: dict) -> str:
    if e.get("unreachable"):
        nodes = "; ".join(f"node {n['node']} (ranks {n['ranks']}) since "
                          f"{time.strftime('%H:%M:%S', time.localtime(n['since']))}"
                          for n in e["unreachable"])
        return (f"unreachable: {nodes}: no heartbeat from it while the job waited {_where(e)} "
                f"({e.get('waited_s', 0):.1f}s, budget {e.get('budget_s', 0):.1f}s); a "
                f"network partition or a frozen node; stacks in {e.get('stack_dump')}")
    what = ("stopped sending heartbeats (killed, frozen or cut off) while the job waited"
            if e.get("why") == "silent" else "made no progress for")
    return (f"hang detected {_where(e)}: rank(s) {e.get('culprit_ranks')} {what} "
            f"{e.get('waited_s', 0):.1f}s (budget {e.get('budget_s', 0):.1f}s); "
            f"stacks in {e.get('stack_dump')}")


def _suspected(e: dict) -> str:
    return (f"warning: {_where(e)} took {e.get('waited_s', 0):.1f}s, over its "
            f"{e.get('budget_s', 0):.1f}s budget, but rank(s) {e.get('culprit_ranks')} are "
            "still computing or moving data: slow, not hung; training goes on")


def headline(error: str) -> str:
    """An error's first line that says something: torch's pipelining
    raises "RuntimeError: " and its text on the lines below."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or [""]
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"[:300]
    return lines[0][:300]


def _error(e: dict) -> str:
    return f"rank {e.get('rank')} failed in {e.get('section')}: {headline(e.get('error', ''))}"


LOST_BY_SIGNAL = "no report of its own (killed, out of memory or crashed)"


def lost_process(e: dict) -> str:
    """A `process_lost` event (launch/reporting.py): the rank whose process
    ended, where, and how."""
    return (f"rank {e.get('rank')} (pid {e.get('pid')} on {e.get('host')}) ended with "
            f"{e.get('how')}")


def _lost(e: dict) -> str:
    report = LOST_BY_SIGNAL if e.get("exitcode", 0) < 0 else "no report of its own"
    return f"{lost_process(e)}: {report}"


def _restart(e: dict) -> str:
    if e.get("kind") == "replace":
        return (f"{e.get('reason')}: replacing that process ({e.get('attempt')} of "
                f"{e.get('max_attempts')}); the other ranks wait in theirs")
    tier = f" ({e['from_tier']} tier)" if e.get("from_tier") else ""
    start = (f"from step {e['from_step']}{tier}" if e.get("from_step") is not None
             else "from the start (no checkpoint yet)")
    if e.get("unsaved_step") is not None:  # a new launch, not an attempt of its budget
        return f"resuming {start}: {e.get('reason')}; {_again(e)}"
    how = "in-process" if e.get("kind") == "in_process" else "by relaunching the workers"
    return (f"restarting {how} {start}, attempt {e.get('attempt')} of "
            f"{e.get('max_attempts')} (cause: {e.get('reason')})")


def _again(e: dict) -> str:
    first, last = (e.get("from_step") or 0) + 1, e["unsaved_step"]
    return (f"step {last} is trained again" if first == last
            else f"steps {first} to {last} are trained again")


def _local_paused(e: dict) -> Optional[str]:
    """Warned once: at the start-up check, and at the first of failed local
    saves in a row (the next ones are in events.jsonl only)."""
    if e.get("retry_at_step") is None:
        return ("warning: the local checkpoint tier is off for this run, global checkpoints go "
                f"on: {e.get('reason')}")
    if e.get("failures") != 1:
        return None
    return (f"warning: the local checkpoint of step {e.get('step')} failed ({e.get('reason')}); "
            f"the local tier pauses until step {e.get('retry_at_step')} (about "
            f"{e.get('retry_after_s') or 0:.0f} s) and retries then, global checkpoints go on")


def _loaded(e: dict) -> str:
    if e.get("tier") == "live":
        peers = e.get("from_peers") or {}
        moved = ", ".join(f"rank {o} from rank {h}" for o, h in sorted(peers.items()))
        return (f"took the state of step {e.get('step')} from the ranks' memory"
                f"{f' ({moved})' if moved else ''}: no completed step lost")
    line = f"resumed from {e.get('path')} (step {e.get('step')})"
    saved, now = e.get("saved_layout") or {}, e.get("layout") or {}
    if saved and saved != now:
        line += f", resharded from {_dims(saved)} to {_dims(now)}"
    not_live = (e.get("skipped") or {}).get("live")
    if not_live:  # live replacement was on and lost steps: say why
        line += f"; the ranks' memory could not serve: {not_live}"
    return line


def _dims(layout: dict) -> str:
    return f"tp{layout.get('tp')}xpp{layout.get('pp')}xdp{layout.get('dp')}"


def _skipped(e: dict) -> str:
    what = "local shard" if e.get("tier") == "local" else "checkpoint"
    return f"skipped {what} {e.get('path')}: {e.get('reason')}"


def _ranks(ranks) -> str:
    return f"rank(s) {ranks}" if ranks else "no single rank"


def _nonfinite(e: dict) -> str:
    began = "".join(f" (routing scores first at {layer} on rank {rank})"
                    for rank, layer in e.get("routers", []))
    return (f"non-finite {e.get('what')} at step {e.get('step')} from {_ranks(e.get('ranks'))}"
            f"{began}; {e.get('next')}")


def _replayed(e: dict) -> str:
    if e.get("outcome") == "transient":
        what = f"step {e.get('step')} is finite on replay: a transient fault"
    else:
        what = f"step {e.get('step')} is non-finite again on replay: a persistent fault"
    return f"{what}, recomputation differed on {_ranks(e.get('differed_ranks'))}; {e.get('next')}"


def _rolled_back(e: dict) -> str:
    causes: dict[Optional[str], str] = {
        "nonfinite": "a persistent non-finite step", "loss_spike": "a loss spike",
        "silent_corruption": "replicas that differ"}
    why = causes.get(e.get("reason"), e.get("reason"))
    counted = (f", rollback {e.get('rollback')} of at most {e.get('max_rollbacks')}"
               if "rollback" in e else "")
    return (f"rolled back from step {e.get('step')} to the checkpoint of step "
            f"{e.get('to_step')} ({why}{counted}); {e.get('next')}")


def _culprit(e: dict) -> str:
    culprit, unresolved = e.get("culprit"), e.get("unresolved")
    if culprit is None:
        return "the corrupted replica is not known yet"
    named = f"corrupted replica on rank(s) {culprit}" if culprit else ""
    if unresolved:
        return (f"{named}; " if named else "") + (
            f"which replica of {unresolved} was corrupted is not known: {e.get('why')}")
    return named or "no replica differed on replay"


def _corruption(e: dict) -> str:
    where = f" in {', '.join(e['tensors'][:3])}" if e.get("tensors") else ""
    return (f"silent data corruption at step {e.get('step')}: data-parallel replicas differ"
            f"{where}; {_culprit(e)}; {e.get('next')}")


NUMERICS: dict[str, Callable[[dict], Optional[str]]] = {
    "nonfinite_detected": _nonfinite,
    "step_replayed": _replayed,
    "rolled_back": _rolled_back,
    "samples_skipped": lambda e: (f"skipped samples {e['samples'][0]}.."
                                  f"{e['samples'][1] - 1} (step {e.get('step')}); "
                                  f"{e.get('next')}"),
    "loss_spike": lambda e: (f"loss spike at step {e.get('step')}: {e.get('loss'):.4g} is "
                             f"{e.get('deviations')} robust deviations above the median "
                             f"{e.get('median'):.4g} (threshold {e.get('threshold')}); "
                             f"{e.get('next')}"),
    "loss_level_shift": lambda e: (f"loss level shift at step {e.get('step')}: "
                                   f"{e.get('steps')} spikes in a row, the loss's median moves "
                                   f"from {e.get('median'):.4g} to {e.get('new_median'):.4g}; "
                                   f"{e.get('next')}"),
    "silent_corruption_detected": _corruption,
    "silent_corruption_attributed": lambda e: (f"replicas replayed to step {e.get('step')}: "
                                               f"{_culprit(e)}; {e.get('next')}"),
    "checkpoint_refused": lambda e: f"checkpoint of step {e.get('step')} refused: {e.get('reason')}",
}


FORMATS: dict[str, Callable[[dict], Optional[str]]] = {
    **NUMERICS,
    "fault_injected": lambda e: f"fault injected on rank {e.get('rank')}: {e.get('fault')}",
    "hang_detected": _hang,
    "hang_suspected": _suspected,
    "worker_error": _error,
    "process_lost": _lost,
    "restart": _restart,
    "checkpoint_loaded": _loaded,
    "initialized_from": lambda e: (f"started from the weights of {e.get('path')}"
                                   + (f" with its optimizer state, at step {e.get('step')}"
                                      if e.get("optimizer") else " (fresh optimizer, step 0)")),
    "checkpoint_skipped": _skipped,
    "preempted": lambda e: (f"preempted: saved step {e.get('step')}; exiting for a requeue "
                            "(run the same command again to continue)"),
    "interrupted": lambda e: f"interrupted: saved step {e.get('step')}, resume with the same command",
    "exited": lambda e: (f"stopped at train.exit_at_step={e.get('step')}, saved; the same "
                         "command without train.exit_at_step continues"),
    "checkpoint_saved": lambda e: (f"checkpoint saved: step {e.get('step')}, "
                                   f"{e.get('bytes', 0) / 1e9:.3f} GB in {e.get('seconds', 0):.1f} s "
                                   f"(loop held {e.get('blocking_seconds', 0):.1f} s), global tier: "
                                   f"{e.get('path')}"),
    "checkpoint_interval": lambda e: e.get("line", ""),
    # The banner and the end summary: printed here, in order with the lines
    # around them, not by the worker.
    "generation_started": lambda e: e.get("line", ""),
    "run_finished": lambda e: e.get("line", ""),
    "startup_phase": startup.describe,
    "local_tier_paused": _local_paused,
}


def is_abort(event: dict) -> bool:
    """A worker_error that is only this rank being aborted by another's incident."""
    return event.get("error", "").startswith("HangAbort")


def describe(event: dict) -> Optional[str]:
    """The console line for an event, or None for routine ones."""
    fmt = FORMATS.get(event.get("event", ""))
    line = fmt(event) if fmt else None
    return f"megaresil: {line}" if line else None


class IncidentPrinter:
    """Follows `run_dir/events.jsonl` from its current end and prints each
    incident's line. Of the worker_error events of one failure (every rank
    reports its own unwinding), only the first is printed, and none that
    only saw its peer go: the lost process's line (or the restart's cause)
    names the rank that was lost, not a survivor. On several nodes each
    launcher follows the same file: only the one that `speaks` (runs the
    job's rank 0) prints, so a console gathering every node's output says
    each line once."""

    def __init__(self, run_dir: Path, out: TextIO = sys.stderr, poll_s: float = 0.2,
                 speaks: Callable[[], bool] = lambda: True):
        self.path = Path(run_dir) / "events.jsonl"
        self.out, self.poll_s, self.speaks = out, poll_s, speaks
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.errors_shown = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="megaresil-incidents",
                                       daemon=True)

    def __enter__(self) -> "IncidentPrinter":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.print_new()  # what the workers wrote last

    def _follow(self) -> None:
        while not self.stop.wait(self.poll_s):
            self.print_new()

    def print_new(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits
        self.offset += len(complete)
        for line in complete.splitlines():
            try:
                event = json.loads(line)
            except ValueError:  # blank, or torn by a kill inside a write and ended by the next
                continue
            if isinstance(event, dict):
                self._show(event)

    def _show(self, event: dict) -> None:
        kind = event.get("event")
        if kind == "worker_error":
            # An abort unwinding a rank, or a closed connection, is the
            # consequence of an incident shown (or of a process that left no
            # report: the restart names it); a fatal error is the launcher's
            # last line.
            if (self.errors_shown or event.get("fatal") or is_abort(event)
                    or event.get("lost_peer")):
                return
            self.errors_shown = True
        elif kind in ("hang_detected", "process_lost"):
            self.errors_shown = True  # every rank's unwinding from it is this incident
        elif kind == "restart":
            # The next failure is a new incident, unless this restart replaces a
            # lost process: its peers' errors (the closed connection) are its
            # consequence, shown as this line.
            self.errors_shown = event.get("kind") == "replace"
        text = describe(event)
        if text and self.speaks():
            print(text, file=self.out, flush=True)
