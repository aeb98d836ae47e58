"""The GPU path: its CPU-checkable logic here, the rest under `pytest -m gpu`
(run by tools/gpu_check.sh on a CUDA machine)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megaresil.config import ConfigError, ModelConfig, Precision, load_recipe
from megaresil.launch.checks import check_local_gpus
from megaresil.model import te
from megaresil.model.gpt import GPT
from megaresil.model.init import initialize
from megaresil.resilience.faults import check_device_faults
from megaresil.train.precision import resolve

from tests.harness.cli import ROOT
from tests.harness.dist import RECIPE, TINY

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_precision_auto_is_fp32_on_cpu_and_bf16_on_cuda():
    assert resolve(Precision.auto, torch.device("cpu")) == Precision.fp32
    assert resolve(Precision.auto, torch.device("cuda", 0)) == Precision.bf16
    assert resolve(Precision.amp, torch.device("cuda", 0)) == Precision.amp


def test_launcher_names_a_gpu_shortfall():
    check_local_gpus(8, 0)  # a CPU machine: gloo workers, no GPU needed
    check_local_gpus(8, 8)
    with pytest.raises(ConfigError, match="needs 8 local workers but this node sees 4 GPU"):
        check_local_gpus(8, 4)


def test_a_device_hang_needs_a_gpu_and_says_so(cli_main):
    hang = {"kind": "hang", "rank": 0, "step": 3, "mode": "device"}
    check_device_faults([hang], 1)
    check_device_faults([{**hang, "mode": "native"}], 0)
    with pytest.raises(ConfigError, match=r"faults\[1\].mode: device hangs a CUDA kernel"):
        check_device_faults([{**hang, "mode": "sleep"}, hang], 0)
    if not torch.cuda.is_available():  # chaos refuses before training its reference
        result = cli_main("chaos", str(RECIPE), "run.dir=/nonexistent/never-written",
                          "--scenario", "hang-on-device", check=False)
        assert result.returncode == 2 and "use mode: native" in result.stderr


def test_te_backend_is_refused_clearly_where_it_cannot_run():
    if te.available():
        pytest.skip("Transformer Engine imports here")
    with pytest.raises(ConfigError, match="model.backend=local"):  # fatal: no restart cures it
        te.require()
    with pytest.raises(ConfigError, match="train.fp8"):
        load_recipe(RECIPE, TINY + ["train.fp8=hybrid"])


def test_gpu_check_dry_run_runs_every_check(tmp_path):
    """In a process of its own, as the device call runs it: what a check
    leaves in its process (process groups, gloo's listening sockets) ends
    with it rather than in the test session's."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    from gpu_check_budget import deadline_s

    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--dry-run",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=deadline_s("checks", dry_run=True) + 60)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    summary = json.loads((out / "gpu_check.json").read_text())  # written after each check
    for check in gpu_check.CHECKS:
        result = summary[check.__name__]
        assert result["status"] in ("ok", "skipped"), (check.__name__, result.get("traceback"))
        assert result["status"] == "ok" or result["skipped"], check.__name__  # with a reason
    assert summary["bf16_vs_fp32_loss"]["ok"]
    assert summary["throughput_1b"]["tokens_per_s"] > 0
    assert summary["checkpoint_io"]["async"]["gb"] > 0
    assert summary["checkpoint_io"]["raw_write_gb_per_s"] > 0
    assert summary["checkpoint_io"]["async"]["saves"] > 1  # a stall over several steps
    assert set(summary["activation_offload"]) >= {"none", "cpu", "step_time_ratio"}


@pytest.fixture
def cuda_default_group():
    """The default group a CUDA job gets (restart.py: `backend_for(cuda)`),
    on a CPU machine: NCCL is swapped for a gloo stand-in registered, like
    NCCL (torch maps "nccl" to ["cuda"]), for CUDA tensors only, so a CPU
    tensor on it raises NCCL's "No backend type associated with device type
    cpu"."""
    import torch.distributed as dist

    from megaresil.parallel.layout import backend_for

    if not hasattr(dist.Backend, "CUDAONLY"):
        dist.Backend.register_backend(
            "cudaonly", lambda store, rank, size, timeout: dist.ProcessGroupGloo(
                store, rank, size, timeout), devices=["cuda"])
    backend = backend_for(torch.device("cuda", 0)).replace("nccl", "cudaonly")
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_cpu_control_collectives_run_on_a_cuda_jobs_groups(cuda_default_group):
    import torch.distributed as dist

    from megaresil.resilience.preemption import PreemptionFlag

    flag = PreemptionFlag()  # not installed: no signal handlers in the test process
    assert flag.requested_anywhere() is None  # the training loop's, on the default group
    assert flag.requested_anywhere(dist.new_group([0])) is None  # a group made like the mesh's
    flag.signalled_at = 1.0
    assert flag.requested_anywhere() == "preempted"
    table = [None]
    dist.all_gather_object(table, {"steps": 1})  # the stragglers' exchange
    assert table == [{"steps": 1}]


class _FailsAfterEachStep:
    """A job whose every generation resumes at step 0, completes step 1 and
    then fails (as every CUDA step did when the preemption flag's CPU tensor
    met an NCCL-only group): no generation gets further than the first."""

    def __init__(self, supervision, generations: list):
        self.supervision, self.generations = supervision, generations
        generations.append(self)

    def run(self) -> str:
        if len(self.generations) > 10:  # restarting for ever: stop the test's loop
            return "finished"
        with self.supervision.section("optimizer", 1):
            pass
        self.supervision.step_done()
        raise RuntimeError("No backend type associated with device type cpu")

    def close(self) -> None:
        pass


def test_a_generation_that_only_repeats_a_step_is_no_progress(tmp_path, monkeypatch):
    import torch.distributed as dist

    from megaresil.resilience import restart
    from megaresil.worker_env import WorkerEnv

    cfg = load_recipe(RECIPE, TINY + [f"run.dir={tmp_path}", "resilience.watchdog.enabled=false",
                                      "resilience.max_in_process_restarts=2",
                                      "resilience.restart_backoff_s=0"])
    monkeypatch.setattr(restart.PreemptionFlag, "install", lambda self: self)
    generations: list = []
    life = restart.WorkerLife(cfg, WorkerEnv.parse({}), torch.device("cpu"),
                              lambda sup: _FailsAfterEachStep(sup, generations),
                              store=dist.HashStore())
    with pytest.raises(RuntimeError, match="device type cpu"):
        life.run()
    # The first generation's step is progress; the two restarts that only redo it are not.
    assert len(generations) == 3


def test_deterministic_kernels_follow_each_recipe(tmp_path):
    from megaresil.train.model_build import make_deterministic

    before = torch.are_deterministic_algorithms_enabled()
    try:
        for setting in ("true", "false", "true"):
            cfg = load_recipe(RECIPE, TINY + [f"train.deterministic={setting}"])
            make_deterministic(cfg, torch.device("cpu"))
            assert torch.are_deterministic_algorithms_enabled() == (setting == "true")
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_cuda_worker_sets_cublas_workspace_before_cuda_starts(monkeypatch):
    from megaresil.launch import worker as launch
    from megaresil.parallel import layout

    seen = {}

    class CudaWouldStartHere(Exception):
        pass

    def pick_device(local_rank=0):
        seen["env"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        raise CudaWouldStartHere

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(layout, "pick_device", pick_device)
    with pytest.raises(CudaWouldStartHere):
        launch.worker(str(RECIPE), TINY + ["train.deterministic=true"])
    assert seen["env"] == ":4096:8"


def test_deterministic_cuda_after_cuda_started_names_the_fix(monkeypatch):
    from megaresil.train.model_build import make_deterministic

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    cfg = load_recipe(RECIPE, TINY + ["train.deterministic=true"])
    before = torch.are_deterministic_algorithms_enabled()
    try:
        with pytest.raises(ConfigError, match="export CUBLAS_WORKSPACE_CONFIG=:4096:8"):
            make_deterministic(cfg, torch.device("cuda", 0))
    finally:
        torch.use_deterministic_algorithms(before)


def _hang_whose_nccl_abort_never_returns(run_dir: str) -> None:
    """A rank hung past its budget on a job with NCCL groups, where
    ProcessGroupNCCL's abort blocks for ever (a teardown queued behind a
    kernel that never ends): the child process of the test below."""
    import threading
    import time
    from pathlib import Path

    import torch.distributed as dist

    from megaresil.config import WatchdogConfig
    from megaresil.events import EventLog
    from megaresil.resilience.watchdog import abort as abort_module
    from megaresil.resilience.watchdog.monitor import Watchdog

    abort_module.has_nccl_groups = lambda: True
    abort_module.abort_process_groups = threading.Event().wait  # never returns
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    cfg = WatchdogConfig(initial_timeout_s=0.5, calibration_steps=100, stall_s=0.5,
                         slow_limit_factor=2.0)
    wd = Watchdog(cfg, rank=0, world=1, store=dist.HashStore(), run_dir=Path(run_dir),
                  events=EventLog(Path(run_dir), 0), exit_on_hang=None, guardian=False)
    wd.begin_generation(0)
    wd.start()
    with wd.section("data", 5):
        started = time.monotonic()
        while time.monotonic() - started < 30:  # what HangAbort would interrupt
            time.sleep(0.05)


def test_the_hang_exit_does_not_wait_on_a_blocked_nccl_abort(tmp_path):
    import multiprocessing

    from megaresil.events import read_events
    from megaresil.resilience.watchdog.abort import HANG_EXIT_CODE

    child = multiprocessing.get_context("spawn").Process(
        target=_hang_whose_nccl_abort_never_returns, args=(str(tmp_path),))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == HANG_EXIT_CODE
    errors = [e for e in read_events(tmp_path) if e["event"] == "worker_error"]
    assert errors and "not freed by the hang abort" in errors[0]["error"]


def test_a_bench_side_tears_down_every_rank_when_one_fails(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    import signal
    import subprocess

    import train_throughput

    ranks = []  # every process run_side starts, to see how each ended
    popen = subprocess.Popen
    monkeypatch.setattr(train_throughput.subprocess, "Popen",
                        lambda *args, **kwargs: ranks.append(popen(*args, **kwargs)) or ranks[-1])
    waiting = [sys.executable, "-c", "import time; time.sleep(600)"]  # a rank on a dead peer
    failing = [sys.executable, "-c", "raise SystemExit('rank 1 failed')"]
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        train_throughput.run_side([waiting, failing], deadline_s=120)
    with pytest.raises(RuntimeError, match="deadline"):
        train_throughput.run_side([waiting], deadline_s=1)
    # How the waiting ranks ended, not how long it took (which a loaded machine
    # stretches): killed, where a side that waited for them would still be
    # waiting out their 600 s (or raised the deadline, not the failure).
    assert [rank.returncode for rank in ranks] == [-signal.SIGKILL, 1, -signal.SIGKILL]


def _stage_group_ranks(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from megaresil.config import ParallelConfig
    from megaresil.parallel.layout import ParallelLayout

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    layout = ParallelLayout.from_config(ParallelConfig(tp=2, pp=2, dp=1), torch.device("cpu"))
    ranks = dist.get_process_group_ranks(layout.stage_group())
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(ranks, f)
    dist.destroy_process_group()


def test_fp8_amax_group_spans_tp_and_dp_of_the_stage(tmp_path):
    import torch.multiprocessing as mp

    from megaresil.ports import free_port

    mp.start_processes(_stage_group_ranks, args=(free_port(), str(tmp_path)), nprocs=4,
                       start_method="spawn")
    groups = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert groups == [[0, 1], [0, 1], [2, 3], [2, 3]]  # (pp, dp, tp) order: stage 0 is 0, 1


# --- on CUDA (pytest -m gpu) -----------------------------------------------------------


def tiny_model(flavour: str) -> GPT:
    extra = {"flavour": "llama", "num_kv_heads": 2} if flavour == "llama" else {}
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=300, max_seq_len=32,
                      **extra)
    model = GPT(cfg)
    initialize(model, cfg, seed=0)
    return model


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_cuda_logits_match_cpu_in_fp32(flavour, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = tiny_model(flavour)
    tokens = torch.randint(300, (2, 32))
    with torch.no_grad():
        cpu = model.logits(tokens)
        gpu = model.cuda().logits(tokens.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=1e-5)


@pytest.mark.gpu
@CUDA
def test_bf16_training_on_cuda_keeps_fp32_main_state(tmp_path):
    from megaresil.parallel.layout import ParallelLayout
    from megaresil.train.loop import Trainer

    cfg = load_recipe(RECIPE, TINY + ["train.precision=bf16", f"run.dir={tmp_path}"])
    trainer = Trainer(cfg, ParallelLayout(device=torch.device("cuda", 0)))
    trainer.run()
    assert {p.dtype for p in trainer.params} == {torch.bfloat16}
    assert {p.dtype for p in trainer.opt_params} == {torch.float32}

