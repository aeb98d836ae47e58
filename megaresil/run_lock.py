"""`run.lock`: one job owns a run directory, one its checkpoint root, and
one the local checkpoint tier's root (which runs may share).

The holder's record (host, pid, process start time, job id, since) is
hard-linked into place, so creation is atomic on NFS too; a holder on this
host is judged by its pid, one on another host by the heartbeat it touches.
A dead holder's lock is not taken over while a process of its job (marked by
`TREE_ENV`) still runs here. Processes presenting one job id share one lock.
The launcher takes it for its rendezvous' job id and tells its workers
(`HELD_ENV`); under a user's own torchrun, rank 0's worker takes it.
docs/fault-tolerance.md ("The run lock") describes the rules."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ContextManager, Iterator, Optional

import psutil

from megaresil.config import ConfigError
from megaresil.worker_env import HELD_ENV

LOCK_NAME = "run.lock"
# Inherited by every process a holder starts: the holder's `token()`.
TREE_ENV = "MEGARESIL_RUN_LOCK_TREE"
# How long a start waits for a dead holder's processes to end before refusing.
ORPHAN_WAIT_S = 15.0
HEARTBEAT_S = 5.0
STALE_S = 30.0
# Looks at a lock that keeps changing under us (refreshed, taken over) before giving up.
ATTEMPTS = 10


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    start_time: float  # the process's creation time: a reused pid has another
    job: str
    since: float  # wall clock when it took the lock

    @classmethod
    def this_process(cls, job: str) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(), job,
                   time.time())

    def token(self) -> str:
        """What the processes this holder starts carry in TREE_ENV."""
        return f"{self.host}:{self.pid}:{self.start_time!r}"

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"job {self.job} (host {self.host}, pid {self.pid}, since {since})"


@dataclass(frozen=True)
class Seen:
    """A lock file as read: its holder (None when the record is unreadable),
    and the bytes and mtime that identify this version of it."""
    holder: Optional[Holder]
    raw: bytes
    mtime_ns: int

    def age_s(self) -> float:
        return time.time() - self.mtime_ns / 1e9


class RunDirInUse(ConfigError):
    """Another job holds the run directory (or the checkpoint root: `key`)."""

    def __init__(self, run_dir: Path, problem: str, key: str = "run.dir"):
        super().__init__(key, f"{run_dir} {problem}",
                         f"wait for that job to end or stop it, or choose another {key}. A lock "
                         "whose holder is gone is taken over by the next start (another host's "
                         f"once its heartbeat is {STALE_S:.0f} s old).")


def read_lock(path: Path) -> Optional[Seen]:
    try:
        with open(path, "rb") as f:
            mtime_ns, raw = os.fstat(f.fileno()).st_mtime_ns, f.read()
    except FileNotFoundError:
        return None
    try:
        holder = Holder(**json.loads(raw))
    except (ValueError, TypeError):  # torn or foreign content: judged by its mtime alone
        holder = None
    return Seen(holder, raw, mtime_ns)


def process_alive(pid: int, start_time: float) -> bool:
    """Whether `pid` on this host is still the process that started at `start_time`."""
    try:
        process = psutil.Process(pid)
        return (abs(process.create_time() - start_time) < 1.0
                and process.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's live process
        return True


def processes_of(holder: Holder) -> list[int]:
    """Live processes of this host started under `holder` (their TREE_ENV
    names it), however deep below it and wherever they were reparented."""
    pids = []
    for process in psutil.process_iter():
        try:
            if (process.environ().get(TREE_ENV) == holder.token()
                    and process.status() != psutil.STATUS_ZOMBIE):
                pids.append(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass  # gone meanwhile, or another user's (never one of ours)
    return pids


class RunLock:
    """Hold `run_dir/run.lock` for job `job` (a context manager)."""

    def __init__(self, run_dir: Path, job: str, *, heartbeat_s: float = HEARTBEAT_S,
                 stale_s: float = STALE_S, orphan_wait_s: float = ORPHAN_WAIT_S,
                 key: str = "run.dir"):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / LOCK_NAME
        self.me = Holder.this_process(job)
        self.heartbeat_s, self.stale_s, self.orphan_wait_s = heartbeat_s, stale_s, orphan_wait_s
        self.key = key  # the recipe key the refusal names
        self.owner = False  # whether the file names this process (else a job mate holds it)
        self._stop = threading.Event()
        self._keeper: Optional[threading.Thread] = None
        self._warned = False

    def __enter__(self) -> "RunLock":
        self._take()
        self._keeper = threading.Thread(target=self._keep, name="run-lock", daemon=True)
        self._keeper.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join()
        seen = read_lock(self.path)
        if seen is not None and seen.holder == self.me:
            self.path.unlink(missing_ok=True)

    # --- taking ----------------------------------------------------------------

    def _take(self) -> None:
        """Own the lock, or join a live one of this job; `RunDirInUse` otherwise."""
        for _ in range(ATTEMPTS):
            seen = read_lock(self.path)
            if seen is None:
                if self._create():
                    self.owner = True
                    return
            elif self._alive(seen):
                if seen.holder is not None and seen.holder.job == self.me.job:
                    self.owner = seen.holder == self.me
                    return
                raise RunDirInUse(self.run_dir, self._in_use(seen), self.key)
            else:
                self._wait_for_orphans(seen)
                self._remove_stale(seen)
        raise RunDirInUse(self.run_dir, f"has a {LOCK_NAME} that kept changing while this job "
                          "tried to take it: another job is starting on it.", self.key)

    def _in_use(self, seen: Seen) -> str:
        who = seen.holder.describe() if seen.holder else "an unreadable lock record"
        beat = ("" if seen.holder and seen.holder.host == self.me.host
                else f", last heartbeat {seen.age_s():.0f} s ago")
        return f"is in use by {who}{beat}: {self.path}."

    def _wait_for_orphans(self, seen: Seen) -> None:
        """A dead holder's job may live on in processes it started (workers
        the kernel is still killing, or ones that escaped): wait for them,
        then refuse naming them; taking over would run two jobs at once."""
        if seen.holder is None or seen.holder.host != self.me.host:
            return  # another host's processes cannot be seen from here
        deadline = time.monotonic() + self.orphan_wait_s
        pids = processes_of(seen.holder)
        if pids:
            print(f"megaresil: waiting for {len(pids)} process(es) of {seen.holder.describe()} "
                  f"(pids {', '.join(map(str, pids))}) to end before taking {self.path} over",
                  file=sys.stderr, flush=True)
        while pids and time.monotonic() < deadline:
            time.sleep(0.1)
            pids = processes_of(seen.holder)
        if pids:
            raise RunDirInUse(self.run_dir, f"is in use by {seen.holder.describe()}: its "
                              f"holder is gone but processes it started still run (pids "
                              f"{', '.join(map(str, pids))}; stop them with kill -9): "
                              f"{self.path}.", self.key)

    def _alive(self, seen: Seen) -> bool:
        if seen.holder is not None and seen.holder.host == self.me.host:
            return process_alive(seen.holder.pid, seen.holder.start_time)
        return seen.age_s() <= self.stale_s

    def _create(self) -> bool:
        record = self.path.with_name(f"{LOCK_NAME}.{self.me.host}.{self.me.pid}.{id(self):x}")
        with open(record, "x") as f:  # a fresh file: never one planted under its name
            f.write(json.dumps(asdict(self.me)) + "\n")
        try:
            with contextlib.suppress(FileExistsError):
                os.link(record, self.path)
            return os.stat(record).st_nlink == 2
        finally:
            record.unlink(missing_ok=True)

    def _remove_stale(self, seen: Seen) -> None:
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{self.me.host}.{self.me.pid}.{id(self):x}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # someone else removed it first
        moved = read_lock(aside)
        if moved is not None and (moved.raw, moved.mtime_ns) != (seen.raw, seen.mtime_ns):
            # It was refreshed or replaced after we judged it: put it back.
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        elif seen.holder is None or seen.holder.job != self.me.job:
            who = seen.holder.describe() if seen.holder else "an unreadable lock record"
            print(f"megaresil: {self.path} of {who} is stale (its holder is gone); "
                  "taking it over", file=sys.stderr)
        aside.unlink(missing_ok=True)

    # --- keeping ---------------------------------------------------------------

    def _keep(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
            except (OSError, RunDirInUse) as err:
                self._warn_once(f"megaresil: warning: run.lock: {err}")

    def _beat(self) -> None:
        """Refresh our lock, or take over our job's lock should it go stale."""
        seen = read_lock(self.path)
        if seen is not None and seen.holder == self.me:
            os.utime(self.path)  # the heartbeat other hosts judge liveness by
            return
        self._take()

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            print(message, file=sys.stderr)


@contextlib.contextmanager
def locks_of_run(run_dir: Path, checkpoint_root: Path, job: str,
                 local_root: Optional[Path] = None) -> Iterator[RunLock]:
    """The run directory's lock (yielded), the checkpoint root's (one lock
    when they are the same directory) and, with the local tier on, its
    root's (`local_root`: on this node; it never lies in the other two)."""
    with contextlib.ExitStack() as stack:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        lock = stack.enter_context(RunLock(run_dir, job))
        if Path(checkpoint_root).resolve() != Path(run_dir).resolve():
            Path(checkpoint_root).mkdir(parents=True, exist_ok=True)
            stack.enter_context(RunLock(checkpoint_root, job, key="checkpoint.dir"))
        if local_root is not None:
            Path(local_root).mkdir(parents=True, exist_ok=True)
            stack.enter_context(RunLock(local_root, job, key="checkpoint.local.dir"))
        yield lock


@contextlib.contextmanager
def held_for_workers(run_dir: Path, job: str, checkpoint_root: Optional[Path] = None,
                     local_root: Optional[Path] = None):
    """The launcher's locks, announced to the workers it starts (they inherit
    the environment) so that they do not take them again, and so that the
    next start knows them for this job's while they live."""
    with locks_of_run(run_dir, checkpoint_root or run_dir, job, local_root) as lock:
        previous = {name: os.environ.get(name) for name in (HELD_ENV, TREE_ENV)}
        os.environ.update({HELD_ENV: str(lock.path), TREE_ENV: lock.me.token()})
        try:
            yield lock
        finally:
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def launcher_pid() -> Optional[int]:
    """The pid of the megaresil launcher this process descends from (the
    TorchElastic agent of its workers), from TREE_ENV; None without one."""
    token = os.environ.get(TREE_ENV)
    return int(token.rsplit(":", 2)[1]) if token else None


def torchrun_job_id() -> str:
    """This torchrun job's id: its rendezvous id, unless torchrun's default
    "none" (not unique), then the address of the job's store."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id != "none":
        return run_id
    return f"torchrun@{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


def held_by_worker(run_dir: Path, rank: int, checkpoint_root: Optional[Path] = None,
                   local_root: Optional[Path] = None) -> ContextManager:
    """Under a torchrun of the user's own (no megaresil launcher above us),
    global rank 0 holds the run directory (and checkpoint root, and its
    node's local root) for the job."""
    if rank != 0 or HELD_ENV in os.environ:
        return contextlib.nullcontext()
    return locks_of_run(run_dir, checkpoint_root or run_dir, torchrun_job_id(), local_root)
