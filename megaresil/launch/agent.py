"""The launcher: the recipe's local workers under a TorchElastic agent
(restarts and error files as under torchrun), and the exit code that says how
the job ended (done, failed, preempted, interrupted)."""
from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Optional

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from megaresil.compat import (
    elastic_agent_class,
    elastic_stores_listening_on,
    lost_peer_message,
    rendezvous_method_names_from_frames,
    workers_store_per_round,
)
from megaresil.config import RecipeConfig
from megaresil.events import EventLog, read_events
from megaresil.launch.admission import NodeExcluded
from megaresil.launch.health import exclusion_after_check, has_checks
from megaresil.launch.membership import Membership
from megaresil.launch.preflight import Preflight, preflight
from megaresil.launch.rendezvous import launch_backend, register_wrapped
from megaresil.launch.reporting import AgentReport, how_it_ended, without_report
from megaresil.launch.spares import NodeCounts, node_counts, spare_keep_alive, spare_line
from megaresil.launch.supervisor import AgentPolicy, supervising_agent
from megaresil.launch.worker import choose_threads
from megaresil.ports import loopback_interface
from megaresil.resilience.incidents import LOST_BY_SIGNAL, IncidentPrinter
from megaresil.resilience.preemption import (
    INTERRUPTED_EXIT,
    PREEMPTED_EXIT,
    kill_descendants,
    second_interrupt_kills_workers,
)
from megaresil.resilience.restart import HANG_EXIT_CODE
from megaresil.run_lock import held_for_workers

LOST_WORKER = re.compile(r"failed \(exitcode: -?\d+\) local_rank: \d+ \(pid: \d+\)")


def worker_record(record: logging.LogRecord) -> bool:
    """TorchElastic's agent logs a failed worker as a timestamped record and
    each worker it stops as another: none of them on the console. The cause
    is there already, from the events: a process that ended without a
    report as `process_lost` (launch/reporting.py), an error as the
    worker's own."""
    message = record.getMessage()
    return not LOST_WORKER.search(message) and "closing signal" not in message


def launch(recipe: str, overrides: list[str], cfg: RecipeConfig,
           membership: Membership = Membership()) -> int:
    """Run local workers under a TorchElastic agent; returns the exit code."""
    flight = preflight(cfg, membership)
    if flight.refusal:
        print(f"megaresil: {flight.refusal}", file=sys.stderr)
        return 1
    choose_threads(flight.nproc)
    if membership.max_nodes == 1:  # the ranks' own sockets too, unless the user chose
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback_interface())
    quiet_elastic_logs(membership)
    register_wrapped()
    nodes = node_counts(membership.min_nodes, membership.max_nodes, membership.spares,
                        cfg.parallel.world_size, flight.nproc, membership.backend)
    if line := spare_line(nodes):
        print(line, file=sys.stderr)
    config = launch_config(cfg, membership, nodes, flight)
    run_dir = flight.run_dir
    events_before = len(read_events(run_dir))
    report = AgentReport()
    policy = agent_policy(cfg, run_dir, nodes, flight.gpus, flight.gpus_needed)
    try:
        with (held_for_workers(run_dir, config.run_id, flight.paths.checkpoint_root,
                               flight.local_root),
              IncidentPrinter(run_dir, speaks=lambda: report.runs_rank_0),
              second_interrupt_kills_workers(),
              elastic_stores_listening_on(config.local_addr), workers_store_per_round(),
              rendezvous_method_names_from_frames(),
              elastic_agent_class(supervising_agent(policy, run_dir, report))):
            # The workers' first line comes once they have imported torch and
            # built the model (seconds, more on a loaded machine): this one first.
            print(f"megaresil: launching {flight.nproc} worker processes"
                  f"{' on this node' if membership.max_nodes > 1 else ''} (each imports torch "
                  "and builds its part of the model before the first step)", file=sys.stderr,
                  flush=True)
            elastic_launch(config, sys.executable)("-m", "megaresil", "train", recipe, *overrides)
    except NodeExcluded as err:  # while it waited: the job goes on without it
        print(f"megaresil: {err.line}", file=sys.stderr)
        return 1
    except ChildFailedError as err:
        relaunches = f"{report.relaunches} relaunch{'' if report.relaunches == 1 else 'es'}"
        print(f"megaresil: giving up after {relaunches}: {failure_summary(err)}; the run "
              "directory keeps the newest checkpoint (rerun the same command to resume after "
              "fixing the cause)", file=sys.stderr)
        return 1
    except RendezvousError as err:
        print(f"megaresil: giving up: {rendezvous_lost(membership, err)}", file=sys.stderr)
        return 1
    except SignalException as err:  # the launcher itself was told to stop
        ending = last_ending(run_dir, events_before)
        if err.sigval == signal.SIGINT:
            return interrupted(ending)
        if ending is None or ending["event"] != "preempted":
            print(f"megaresil: stopped by {err.sigval.name} before a checkpoint", file=sys.stderr)
            return 128 + err.sigval.value
    return ended(last_ending(run_dir, events_before))


def quiet_elastic_logs(membership: Membership) -> None:
    """Leave the console to megaresil's own lines: TorchElastic's records of
    what the events already say are filtered out."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(worker_record)
    # "Received 2 death signal": the workers' own `interrupted`/`preempted` line says it better.
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in record.getMessage())
    if membership.backend == "etcd":  # it logs every step of every round, on its own handler
        from torch.distributed.elastic.rendezvous import etcd_rendezvous
        etcd_rendezvous.logger.setLevel(logging.WARNING)


def launch_config(cfg: RecipeConfig, membership: Membership, nodes: NodeCounts,
                  flight: Preflight) -> LaunchConfig:
    return LaunchConfig(
        min_nodes=nodes.min_nodes, max_nodes=nodes.max_nodes, nproc_per_node=flight.nproc,
        rdzv_backend=launch_backend(membership.backend),
        rdzv_endpoint=membership.rendezvous_endpoint,
        local_addr=membership.local_addr,
        # Wait 5 s (not 30) for more nodes once the minimum is there, and call
        # a node gone after ~2 s without keep-alives (not 15): a job that lost
        # a node re-forms in seconds.
        rdzv_configs={"last_call_timeout": 5, "join_timeout": 120, "keep_alive_interval": 1,
                      "keep_alive_max_attempt": 2, **spare_keep_alive(nodes),
                      **membership.rdzv_conf},
        run_id=membership.run_id or f"megaresil-{os.getpid()}",
        max_restarts=cfg.resilience.max_restarts, monitor_interval=0.1,
        shutdown_timeout=int(cfg.resilience.preemption_grace_s),
        logs_specs=DefaultLogsSpecs(log_dir=str(flight.run_dir / "elastic")),
        # SIGUSR1 too: schedulers send it as the early preemption warning
        # (Slurm's --signal=USR1@grace). The agent hands it to every worker,
        # which saves and exits; unhandled, it would kill the agent at once.
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    )


def ended(ending: Optional[dict]) -> int:
    """The exit code of a launch whose agent returned: by how the job ended."""
    if ending and ending["event"] == "run_failed":
        print(f"megaresil: giving up: rank {ending.get('rank')}: {ending.get('error')} "
              "(no restart can fix this)", file=sys.stderr)
        return 1
    return PREEMPTED_EXIT if ending and ending["event"] == "preempted" else 0


def agent_policy(cfg: RecipeConfig, run_dir: Path, nodes: NodeCounts, gpus: int,
                 gpus_needed: int) -> Optional[AgentPolicy]:
    """What the agent supervises beyond TorchElastic's own: live replacement
    (resilience.replacement), the end of a spare's wait and the node's
    health checks while it waits; None for neither."""
    replacement = cfg.resilience.replacement
    if not replacement.enabled and not nodes.spares:
        return None
    health = cfg.resilience.health
    check = (lambda: exclusion_after_check(health, run_dir, gpus, gpus_needed,
                                           EventLog(run_dir))) if has_checks(health, gpus) else None
    return AgentPolicy(run_dir, replacement.max_replacements if replacement.enabled else 0,
                       replacement.enabled and replacement.standby,
                       cfg.resilience.preemption_grace_s, bool(nodes.spares), check,
                       health.interval_s)


def interrupted(ending: Optional[dict]) -> int:
    """Ctrl-C: the agent handed SIGINT to the workers, which saved (the
    incident line says which step); a second Ctrl-C ended the agent's wait
    for them: stop them at once."""
    if ending is None or ending["event"] != "interrupted":
        kill_descendants()
        print("megaresil: second Ctrl-C: stopped at once without saving (rerun the same "
              "command to resume from the newest checkpoint)", file=sys.stderr)
    return INTERRUPTED_EXIT


def failure_summary(err: ChildFailedError) -> str:
    """One line for the failure that ended the job: rank, exit, and the
    exception's own first line (not TorchElastic's traceback dump)."""
    rank, failure = root_failure(err)
    if failure.exitcode == HANG_EXIT_CODE:
        what = "a hang (see the hang line above and run.dir/hangs/)"
    elif without_report(failure):
        what = (LOST_BY_SIGNAL if failure.exitcode < 0 else "the process exited without a report")
    else:
        what = first_line_of(failure)
    return f"rank {rank} ended with {how_it_ended(failure.exitcode)}: {what[:300]}"


def root_failure(err: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The earliest failure that is not a lost peer, else the earliest. A
    rank whose peer failed sees only gloo's "Connection closed by peer", and
    may record it in the same second as the peer records its own cause, or
    before (TorchElastic's get_first_failure takes the earliest, in whole
    seconds)."""
    failures = sorted(err.failures.items(), key=lambda item: item[1].timestamp)
    own = [item for item in failures if not lost_peer_message(first_line_of(item[1]))]
    return (own or failures)[0]


def first_line_of(failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):  # an error file written by @record
        message = message.get("message", "")
    return next(iter(str(message).strip().splitlines()), "")


def rendezvous_lost(membership: Membership, err: RendezvousError) -> str:
    """Why the agents can no longer meet, and, when the c10d host is gone,
    what survives that."""
    if isinstance(err, RendezvousClosedError):  # etcd keeps a finished job's rendezvous
        return (f"the rendezvous {membership.run_id!r} at {membership.endpoint} is closed: a job "
                "with this --rdzv-id already ended; give every job (and every requeue of it) "
                "its own --rdzv-id")
    if membership.host_can_be_lost or not isinstance(err, RendezvousConnectionError):
        return f"the rendezvous at {membership.endpoint} failed: {type(err).__name__}: {err}"
    return (f"the c10d rendezvous host {membership.endpoint} is gone or out of reach (the "
            "agent started with is_host=1, usually the first node, was lost or cut off from "
            "this one), so this node cannot rejoin; to survive losing any node, run the "
            "rendezvous in etcd: --rdzv-backend etcd-v2 --rdzv-endpoint ETCD_HOST:PORT")


def last_ending(run_dir: Path, events_before: int) -> Optional[dict]:
    """How this launch's job ended, by the last ending event it wrote."""
    ends = [e for e in read_events(run_dir)[events_before:]
            if e["event"] in ("preempted", "interrupted", "run_finished", "run_failed")]
    return ends[-1] if ends else None

