"""megaresil under Slurm: the environment read by `megaresil train` inside
`srun`, and the sbatch template run end to end on a real one-host cluster
(preempted with the signal Slurm sends, requeued, resumed to the losses of an
uninterrupted run), in both launcher modes."""
from __future__ import annotations

import sys

import pytest

from tests.harness.daemons import serve, wait_until
from tests.harness.cli import ROOT
from tests.harness.dist import TINY
from megaresil.config import ConfigError
from megaresil.events import read_events, read_metrics
from megaresil.launch.membership import Membership
from megaresil.slurm import PORT_BASE, SlurmStep, expand_counts
from tests.harness.slurm_cluster import LocalSlurm, missing_reason

TEMPLATE = ROOT / "tools" / "slurm" / "train.sbatch"


def step_env(**changes: str) -> dict[str, str]:
    """A 2-node step with 4 tasks per node, as srun sets it up."""
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "8",
           "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NODELIST": "gpu7,gpu8"}
    return {**env, **changes}


def test_slurm_task_counts_expand():
    assert expand_counts("4(x2),1") == [4, 4, 1]
    assert expand_counts("8") == [8]


def test_slurm_is_not_read_outside_srun():
    batch_script = {k: v for k, v in step_env().items() if not k.startswith("SLURM_STEP")}
    assert SlurmStep.from_environ(batch_script) is None


def test_slurm_task_per_rank_becomes_torchrun_environment():
    step = SlurmStep.from_environ(step_env())
    assert step.one_task_per_rank
    env = step.worker_env(world=8)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == \
        ("5", "8", "1", "4")
    assert env["MASTER_ADDR"] == "gpu7" and env["MASTER_PORT"] == str(PORT_BASE + 4242)
    with pytest.raises(ConfigError, match="--ntasks=16"):
        step.worker_env(world=16)


def test_slurm_task_per_node_is_one_agent_per_node():
    step = SlurmStep.from_environ(step_env(SLURM_STEP_NUM_TASKS="2", SLURM_PROCID="1",
                                           SLURM_LOCALID="0", SLURM_STEP_TASKS_PER_NODE="1(x2)",
                                           MASTER_PORT="31000"))
    assert not step.one_task_per_rank
    members = Membership.for_slurm(step, world=8, nproc_per_node=None)
    assert (members.min_nodes, members.max_nodes, members.nproc_per_node) == (2, 2, 4)
    assert members.endpoint == "gpu7:31000" and members.run_id == "slurm-4242"
    gpus = SlurmStep.from_environ(step_env(SLURM_STEP_TASKS_PER_NODE="1(x2)",
                                           SLURM_GPUS_ON_NODE="8"))
    assert Membership.for_slurm(gpus, world=16, nproc_per_node=None).nproc_per_node == 8
    with pytest.raises(ConfigError, match="do not split evenly"):
        Membership.for_slurm(step, world=7, nproc_per_node=None)


# ---- end to end on a real cluster ----------------------------------------

RUN = TINY + ["parallel.dp=2", "train.steps=40", "checkpoint.interval=100"]
# Rank 0 computes 0.2 s more per step (both ranks then wait on it), so the
# preemption signal surely lands mid-run; the fault fires once per run
# directory, so the requeued job runs at full speed.
SLOW = "faults=[{kind: slow, rank: 0, step: 1, seconds: 0.2}]"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from serve(LocalSlurm, missing_reason, tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from tests.harness.cli import megaresil_cli

    run_dir = tmp_path_factory.mktemp("slurm-ref")
    megaresil_cli("train", "recipes/gpt-tiny.yaml", *RUN, f"run.dir={run_dir}")
    return {m["step"]: m["loss"] for m in read_metrics(run_dir)}


def wait_for_step(run_dir, step: int, timeout: float = 180) -> None:
    wait_until(lambda: (run_dir / "metrics.jsonl").exists() and any(
        m["step"] >= step for m in read_metrics(run_dir)), timeout, 0.3,
               lambda: f"no step {step} in {run_dir} within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("tasks_per_node", [1, 2], ids=["agent-per-node", "task-per-rank"])
def test_slurm_preempted_job_requeues_and_resumes_exactly(slurm, reference, tmp_path,
                                                          tasks_per_node):
    run_dir = tmp_path / "run"
    job = slurm.sbatch(f"--ntasks-per-node={tasks_per_node}", f"--chdir={ROOT}",
                       f"--output={tmp_path}/slurm-%j.out", str(TEMPLATE),
                       "recipes/gpt-tiny.yaml", *RUN, SLOW, f"run.dir={run_dir}",
                       env={"MEGARESIL": f"{sys.executable} -m megaresil"})
    wait_for_step(run_dir, 3)
    slurm.signal_batch(job, "USR1")
    info = slurm.wait_done(job, timeout=300)
    console = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", console

    events = read_events(run_dir)
    preempted = [e for e in events if e["event"] == "preempted"]
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert preempted and loaded and loaded[-1]["step"] == preempted[0]["step"], console
    assert 3 <= preempted[0]["step"] < 40
    losses = {m["step"]: m["loss"] for m in read_metrics(run_dir)}
    assert losses == reference  # bit for bit, every step, across the requeue
