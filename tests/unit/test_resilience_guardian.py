"""The guardian kills a rank whose monitor stopped ticking (the GIL held in
C code), unless the stack dump's signal ended the call that held it."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A rank as far as the guardian sees it: a tick file its "monitor" writes,
# faulthandler on SIGUSR2, the guardian started as its child; then the GIL
# held in libc's sleep, which a signal ends. `resume`: it ticks again after
# (a call the signal ended); otherwise it goes back to sleep, ticking never.
RANK = textwrap.dedent("""
    import ctypes, faulthandler, os, signal, struct, subprocess, sys, tempfile, time
    resume = sys.argv[1] == "resume"
    tick = tempfile.NamedTemporaryFile(delete=False)
    def beat():
        tick.seek(0); tick.write(struct.pack("d", time.monotonic())); tick.flush()
    beat()
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    guardian = subprocess.Popen([sys.executable, "-m", "megaresil.resilience.guardian",
                                 str(os.getpid()), tick.name, "1.0"])
    time.sleep(0.5)  # the guardian is watching
    while True:
        ctypes.PyDLL(None).sleep(60)  # holds the GIL until a signal ends it
        if resume:
            break
    for _ in range(40):  # runs again: ticks for 2 s, then ends well
        beat(); time.sleep(0.05)
""")


@pytest.mark.parametrize("resume", [True, False], ids=["runs-again", "held"])
def test_the_guardian_kills_a_rank_holding_the_gil_unless_the_dump_freed_it(resume):
    rank = subprocess.run([sys.executable, "-c", RANK, "resume" if resume else "held"],
                          capture_output=True, text=True, timeout=60)
    assert "made no progress for" in rank.stderr
    assert "(most recent call first)" in rank.stderr  # the stacks were dumped either way
    if resume:
        assert rank.returncode == 0, rank.stderr
        assert "runs again after the stack dump (the call that held it returned): not killed" \
            in rank.stderr
    else:
        assert rank.returncode == -9 and "not killed" not in rank.stderr
