"""Detect, restart, recover: hang detection, fault injection, preemption and
in-process restarts."""
