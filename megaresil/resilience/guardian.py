"""The guardian: a stdlib-only side process per rank (no torch import, so it
starts in milliseconds) that catches hangs the in-process monitor cannot:
a training thread holding the GIL in C code starves the monitor thread.

The monitor writes a timestamp (CLOCK_MONOTONIC, which all processes of a
host share) into a memory-mapped tick file at every poll. When the tick is
older than the timeout, the guardian asks the rank for a stack dump
(SIGUSR2, handled in C by faulthandler, which needs no GIL), then kills it
unless the tick moved meanwhile (the signal ended the C call: the rank's own
watchdog handles the rest); the launcher restarts the worker group.
The kernel kills the guardian when its rank ends (`die_with_parent`).

Usage: python -m megaresil.resilience.guardian PID TICK_FILE TIMEOUT_S
"""
import ctypes
import os
import signal
import struct
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DUMP_S = 1.0  # the rank's time to write its stacks (and to show it runs again)


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when its parent ends, however the
    parent died (kill -9 included), so no process of a job outlives its
    supervisor. A parent that ended before the call sent nothing: the
    parent pid checked afterwards closes that race (an orphan has another)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)  # quietly, as the signal would have


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): state T or t in
    /proc/PID/stat, the field after the parenthesised command name."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def why_no_progress(pid: int) -> str:
    if stopped(pid):
        return "not running: stopped or starved"
    return "its monitor thread starved (GIL held by C code?)"


def read_tick(tick_file: str) -> float:
    with open(tick_file, "rb") as f:
        return struct.unpack("d", f.read(8))[0]


def watch(pid: int, tick_file: str, timeout: float) -> None:
    while alive(pid) and os.getppid() == pid:
        time.sleep(min(0.5, timeout / 4))
        tick = read_tick(tick_file)
        if time.monotonic() - tick > timeout and alive(pid):
            print(f"megaresil guardian: rank process {pid} made no progress for "
                  f"{time.monotonic() - tick:.1f}s, {why_no_progress(pid)}; "
                  "dumping stacks, then killing it unless it runs again", file=sys.stderr,
                  flush=True)
            os.kill(pid, signal.SIGUSR2)
            time.sleep(DUMP_S)
            if read_tick(tick_file) > tick:
                # Killed now, it would relaunch a job whose ranks are already
                # restarting in place (a soak met it).
                print(f"megaresil guardian: rank process {pid} runs again after the stack "
                      "dump (the call that held it returned): not killed",
                      file=sys.stderr, flush=True)
                continue
            os.kill(pid, signal.SIGKILL)
            return


if __name__ == "__main__":
    die_with_parent(int(sys.argv[1]))
    # Ctrl-C is for the rank, which saves and exits; the guardian ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
