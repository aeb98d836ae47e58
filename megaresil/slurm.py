"""Running inside a Slurm job step: read Slurm's environment so that
`megaresil train` under `srun` needs no extra flags, in either of the two
launcher modes Megatron and NeMo users run:

- one task per node (`srun --ntasks-per-node=1 megaresil train ...`): each
  task is a TorchElastic agent that starts its node's ranks, so failed workers
  are relaunched on the spot; the agents meet at a c10d rendezvous on the
  step's first node.
- one task per rank (`srun --ntasks-per-node=<ranks per node> ...`): each
  task is one worker; Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID become
  torchrun's RANK/WORLD_SIZE/LOCAL_RANK. Restarts are in-process only; a
  preempted or failed step ends and the batch script requeues the job.

A step runs one task per rank when it has more than one task on a node;
otherwise each task is an agent.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional

from megaresil.config import ConfigError

# Rendezvous/store port when the user sets none: derived from the job id so
# every node computes the same one without talking, and two jobs sharing a
# node (rare: most clusters give nodes exclusively) rarely collide.
PORT_BASE, PORT_SPAN = 29500, 10000


def expand_counts(compressed: str) -> list[int]:
    """Slurm's per-node task counts, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in compressed.split(","):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not found:
            raise ValueError(f"unreadable Slurm task count {compressed!r}")
        counts += [int(found[1])] * int(found[2] or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list; a compressed one ("gpu[01-04]")
    is expanded by `scontrol`, which is present wherever Slurm runs."""
    if "[" not in nodelist:
        return nodelist.split(",")[0]
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                           capture_output=True, text=True).stdout.split()
    return hosts[0]


def fitting_task_layout(world: int, nodes: int) -> str:
    """The sbatch/srun flags of one task per rank for `world` ranks: on the
    step's node count when it divides them, else on one node."""
    nodes = nodes if world % nodes == 0 else 1
    return f"--nodes={nodes} --ntasks-per-node={world // nodes}"


@dataclass(frozen=True)
class SlurmStep:
    """The Slurm job step this process is a task of."""
    job_id: str
    nodes: int
    tasks: int
    task_rank: int       # SLURM_PROCID
    local_rank: int      # SLURM_LOCALID
    node_rank: int       # SLURM_NODEID
    tasks_on_node: int
    master: str          # the step's first host
    port: int
    gpus_on_node: Optional[int]

    @classmethod
    def from_environ(cls, env: Mapping[str, str] = os.environ) -> Optional["SlurmStep"]:
        """The step, or None outside `srun` (a batch script itself, or no Slurm)."""
        if "SLURM_JOB_ID" not in env or "SLURM_STEP_NUM_TASKS" not in env:
            return None
        node_rank = int(env.get("SLURM_NODEID", "0"))
        job_id = env["SLURM_JOB_ID"]
        gpus = env.get("SLURM_GPUS_ON_NODE")
        return cls(job_id=job_id, nodes=int(env["SLURM_STEP_NUM_NODES"]),
                   tasks=int(env["SLURM_STEP_NUM_TASKS"]), task_rank=int(env["SLURM_PROCID"]),
                   local_rank=int(env["SLURM_LOCALID"]), node_rank=node_rank,
                   tasks_on_node=expand_counts(env["SLURM_STEP_TASKS_PER_NODE"])[node_rank],
                   master=first_host(env["SLURM_STEP_NODELIST"]),
                   port=int(env.get("MASTER_PORT") or PORT_BASE + int(job_id) % PORT_SPAN),
                   gpus_on_node=int(gpus) if gpus else None)

    @property
    def one_task_per_rank(self) -> bool:
        return self.tasks_on_node > 1

    @property
    def job_name(self) -> str:
        return f"slurm-{self.job_id}"

    def worker_env(self, world: int) -> dict[str, str]:
        """torchrun's worker environment from Slurm's, for one task per rank."""
        if self.tasks != world:
            raise ConfigError("parallel", f"the Slurm step has {self.tasks} tasks "
                              f"({self.nodes} node(s) x {self.tasks_on_node}) but the "
                              f"recipe's tp*pp*dp is {world}.",
                              f"submit with {fitting_task_layout(world, self.nodes)} "
                              f"(--ntasks={world}, one task per rank), or "
                              "--ntasks-per-node=1 to let megaresil start the ranks.")
        return {"RANK": str(self.task_rank), "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.tasks_on_node),
                "GROUP_RANK": str(self.node_rank), "MASTER_ADDR": self.master,
                "MASTER_PORT": str(self.port), "TORCHELASTIC_RUN_ID": self.job_name}

    def ranks_per_node(self, world: int) -> int:
        """Workers each agent starts: the node's GPUs when Slurm gave some,
        else an even share of the recipe's ranks."""
        if self.gpus_on_node:
            return self.gpus_on_node
        if world % self.nodes:
            raise ConfigError("parallel", f"tp*pp*dp={world} ranks do not split evenly over "
                              f"the step's {self.nodes} nodes",
                              "choose a node count that divides tp*pp*dp, or pass "
                              "--nproc-per-node.")
        return world // self.nodes
