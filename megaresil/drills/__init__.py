"""Drills: faults injected into real training runs, measured against a
fault-free reference (`megaresil chaos`, `megaresil soak`). Test harnesses,
not runtime: the runtime keeps only the injection hooks
(resilience/faults.py), and no runtime package imports this one (only cli).

- scenarios: the chaos scenario table
- run: starting `megaresil train` runs, requeues, node loss, killing trees
- hosts: where a drill's nodes run: this machine, or namespaces of their own
- schedule: the soak's episodes and their seeded fault schedule
- analyse: recovery measured from a run's records, false alarms, final state
- chaos, soak: the two commands end to end, with their console tables
- replay: a soak's schedule replayed through the plan simulator
"""
