"""The guardian: a stdlib-only side process per rank (no torch import, so it
starts in milliseconds) that catches hangs the in-process monitor cannot:
a training thread holding the GIL in C code starves the monitor thread.

The monitor writes a timestamp into a memory-mapped tick file at every poll
(CLOCK_MONOTONIC, which all processes of a host share, so a wall-clock
step cannot fake or hide a stall).
When the tick is older than the timeout, the guardian asks the rank for a
stack dump (SIGUSR2, handled in C by faulthandler, which needs no GIL),
then kills it; the launcher restarts the worker group.

Usage: python -m megaresil.resilience.guardian PID TICK_FILE TIMEOUT_S
"""
import os
import signal
import struct
import sys
import time


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def watch(pid: int, tick_file: str, timeout: float) -> None:
    while alive(pid) and os.getppid() != 1:
        time.sleep(min(0.5, timeout / 4))
        with open(tick_file, "rb") as f:
            (tick,) = struct.unpack("d", f.read(8))
        if time.monotonic() - tick > timeout and alive(pid):
            print(f"megaresil guardian: rank process {pid} made no progress for "
                  f"{time.monotonic() - tick:.1f}s with its monitor starved (GIL held); "
                  "dumping stacks and killing it", file=sys.stderr, flush=True)
            os.kill(pid, signal.SIGUSR2)
            time.sleep(1.0)
            os.kill(pid, signal.SIGKILL)
            return


if __name__ == "__main__":
    # Ctrl-C is for the rank, which saves and exits; the guardian ends with it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
