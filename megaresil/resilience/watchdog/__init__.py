"""Hang detection, one monitor thread per rank (docs/watchdog.md tells it all).

Each section of a step has a budget calibrated from its measured durations
(`budgets`). When a judging rank's section passes its budget (eight judge,
spread over the job), the culprits are named from every rank's heartbeat, and each is judged stuck or merely
slow by whether its training thread still uses CPU (`judgement`): stuck, or
past the hard limit, is `hang_detected` and the generation is aborted; still
computing is one `hang_suspected` for the job, and training goes on. The
abort (`abort`) dumps stacks, aborts NCCL and raises HangAbort in the
training thread; a thread that abort cannot reach makes the process exit
with HANG_EXIT_CODE (86) for a relaunch, and a stdlib-only guardian process
catches a thread holding the GIL. `monitor.Watchdog` composes them on an
injected clock (megaresil/clock.py); `probes` reads this process.
"""
