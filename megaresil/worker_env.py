"""A worker's environment: what its launcher (megaresil's own, TorchElastic's
agent under torchrun, or a Slurm step) tells it in environment variables,
parsed once where the worker starts and handed down, so the parts below the
launcher take values, not `os.environ`. docs/architecture.md ("Worker
environment and clock")."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

# Set by megaresil's launcher in its workers' environment: the run lock it
# holds for them (run_lock.py); its presence says the launcher ran the checks.
HELD_ENV = "MEGARESIL_RUN_LOCK"
# Set by the agent in a replacement's environment (live replacement).
REPLACEMENT_ENV = "MEGARESIL_REPLACEMENT"


@dataclass(frozen=True)
class WorkerEnv:
    rank: int
    world: int
    local_rank: int  # this rank's place on its node (its GPU)
    local_world: Optional[int]  # ranks on this node, when the launcher says
    node_rank: int  # its agent's node rank (0 without an agent)
    master_addr: Optional[str]  # the launch store's host and port
    master_port: Optional[int]
    restart_count: int  # the agent's relaunches so far
    agent_store: bool  # the agent of node rank 0 hosts the launch store
    elastic_run_id: Optional[str]  # set under a TorchElastic agent
    under_launcher: bool  # megaresil's own launcher started this worker
    replacement: bool  # started in place of a lost process

    @classmethod
    def parse(cls, env: Mapping[str, str] = os.environ) -> WorkerEnv:
        rank = int(env.get("RANK", "0"))
        port = env.get("MASTER_PORT")
        local_world = env.get("LOCAL_WORLD_SIZE")
        return cls(rank=rank, world=int(env.get("WORLD_SIZE", "1")),
                   local_rank=int(env.get("LOCAL_RANK", str(rank))),
                   local_world=int(local_world) if local_world else None,
                   node_rank=int(env.get("GROUP_RANK", "0")),
                   master_addr=env.get("MASTER_ADDR"),
                   master_port=int(port) if port else None,
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   elastic_run_id=env.get("TORCHELASTIC_RUN_ID"),
                   under_launcher=HELD_ENV in env,
                   replacement=env.get(REPLACEMENT_ENV) == "1")
