"""megaresil's tests, arranged by kind (one package, so every module imports
its helpers as `from tests.harness.<module> import ...`, whatever directory
pytest is started from):

- unit/: one process (the CLI's `main()` in process at most; a few slow tests
  at the end of a file go further), named test_<part>_<topic>.py after the
  part of megaresil they test;
- multirank/: starts gloo ranks itself (tests.harness.dist) and compares them
  with the single-process run;
- e2e/: runs jobs through the `megaresil` command in subprocesses (chaos,
  Slurm, etcd, a killed supervisor) and the user journeys (`-m journey`:
  the installed command from a fresh directory);
- gpu/: the files tools/gpu_check.sh runs under `pytest -m gpu` on a CUDA
  machine (their CPU-checkable parts run everywhere);
- harness/: what the tests share, no tests of its own.
"""
