"""Start training: as the TorchElastic launcher (outside torchrun) or as one
worker (inside torchrun or our own launch)."""
from __future__ import annotations

import dataclasses
import ipaddress
import logging
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import yaml
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import (ChildFailedError, get_error_handler,
                                                             record)
from torch.distributed.elastic.rendezvous import (RendezvousClosedError,
                                                  RendezvousConnectionError, RendezvousError)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from megaresil.checkpoint.local_tier import local_root
from megaresil.checkpoint.location import checkpoint_root
from megaresil.checkpoint.recipe_check import check_resume_recipe
from megaresil.compat import elastic_stores_listening_on
from megaresil.config import ConfigError, RecipeConfig, load_recipe, validate, validate_world_size
from megaresil.events import EventLog, read_events
from megaresil.observe.startup import StartupPhases
from megaresil.parallel.layout import visible_gpus
from megaresil.ports import LOOPBACK, address_towards, is_loopback_name, loopback_interface
from megaresil.resilience.faults import check_device_faults, check_fault_ranks
from megaresil.resilience.incidents import IncidentPrinter
from megaresil.resilience.preemption import (INTERRUPTED_EXIT, PREEMPTED_EXIT, kill_descendants,
                                             second_interrupt_kills_workers)
from megaresil.resilience.restart import HANG_EXIT_CODE
from megaresil.resilience.supervision import end_with_agent
from megaresil.run_lock import HELD_ENV, held_by_worker, held_for_workers
from megaresil.safe_files import refuse_links
from megaresil.slurm import SlurmStep
from megaresil.train.save_schedule import never_saving_warning


@dataclass
class Membership:
    """Which agents form the job: one (this machine) by default, or several
    that meet at a rendezvous endpoint, like torchrun's --nnodes."""
    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: Optional[int] = None
    endpoint: str = "localhost:0"
    run_id: Optional[str] = None
    rdzv_conf: dict = dataclasses.field(default_factory=dict)
    # c10d: the rendezvous store lives in the agent started with is_host=1,
    # which must outlive the others; etcd, etcd-v2: in an etcd server apart
    # from the training nodes, so any node may be lost.
    backend: str = "c10d"
    node_address: Optional[str] = None  # --local-addr: where this node's stores listen

    @classmethod
    def parse(cls, nnodes: Optional[str], nproc_per_node: Optional[int], endpoint: Optional[str],
              run_id: Optional[str], rdzv_conf: str = "", backend: str = "c10d",
              local_addr: Optional[str] = None) -> "Membership":
        if not nnodes:
            return cls(nproc_per_node=nproc_per_node, node_address=local_addr)
        conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if item)
        low, _, high = nnodes.partition(":")
        if not endpoint:
            where = "HOST:PORT" if backend == "c10d" else "ETCD_HOST:PORT"
            raise ConfigError("--rdzv-endpoint", "several nodes need a rendezvous endpoint.",
                              f"add --rdzv-endpoint {where} (the same on every node).")
        return cls(int(low), int(high or low), nproc_per_node, endpoint, run_id, conf, backend,
                   local_addr)

    @property
    def host_can_be_lost(self) -> bool:
        return self.backend != "c10d" or self.max_nodes == 1

    @property
    def rendezvous_endpoint(self) -> str:
        """Where the agents meet: on one node, a c10d rendezvous at this
        node's address (loopback unless --local-addr), where its store listens."""
        if self.max_nodes > 1 or self.backend != "c10d":
            return self.endpoint
        return f"{self.local_addr}:{parse_rendezvous_endpoint(self.endpoint, default_port=0)[1]}"

    @property
    def local_addr(self) -> Optional[str]:
        """This node's address, where its stores listen and what its workers
        get as MASTER_ADDR: loopback on one node; on several, the interface
        that reaches the rendezvous endpoint (the network the job runs on).
        None (torch's own: the host name, stores on every interface) when that
        is loopback but the endpoint is not named so: a host name that
        resolves to 127.0.1.1 here (Debian's /etc/hosts), which the other
        nodes reach by another address. --local-addr overrides all of this."""
        if self.node_address:
            return self.node_address
        if self.max_nodes == 1:
            return LOOPBACK
        host, port = parse_rendezvous_endpoint(self.endpoint, default_port=0)
        address = address_towards(host, port)
        if address and ipaddress.ip_address(address).is_loopback and not is_loopback_name(host):
            return None
        return address

    @classmethod
    def for_slurm(cls, step: SlurmStep, world: int, nproc_per_node: Optional[int],
                  backend: str = "c10d", etcd_endpoint: Optional[str] = None) -> "Membership":
        """One agent per node of the Slurm step, meeting on its first node
        (c10d) or at an etcd server, where each requeue of the job needs a
        rendezvous of its own (etcd keeps a finished one, closed)."""
        nodes, nproc = step.nodes, nproc_per_node or step.ranks_per_node(world)
        if backend == "c10d":
            return cls(nodes, nodes, nproc, f"{step.master}:{step.port}", step.job_name)
        requeue = os.environ.get("SLURM_RESTART_COUNT", "0")
        return cls.parse(f"1:{nodes}", nproc, etcd_endpoint, f"{step.job_name}-{requeue}",
                         backend=backend)


def _flat_keys(prefix: str, values: dict) -> dict[str, object]:
    """{'model.rope_scaling.type': ...} from nested {'rope_scaling': {'type': ...}}."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat_keys(f"{prefix}{key}.", value))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _yaml_scalar(value: object) -> str:
    """A value as an override's text (overrides are parsed as YAML)."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


@dataclass
class FromHF:
    """`megaresil train RECIPE --from-hf DIR` resolved: the overrides, and the
    lines that say what DIR changed (recipe values it replaces, settings it
    has that megaresil cannot carry)."""
    overrides: list[str]
    replaced: list[tuple[str, object, object]]  # (key, the recipe's value, DIR's)
    notes: list[str]

    def report(self) -> str:
        """One compact block for the console of a new run."""
        lines = [f"megaresil: {note}" for note in self.notes]
        if self.replaced:
            lines.append("megaresil: --from-hf replaces the recipe's values (recipe -> "
                         "config.json):")
            width = max(len(key) for key, _, _ in self.replaced)
            lines += [f"  {key:<{width}}  {ours!r} -> {theirs!r}"
                      for key, ours, theirs in self.replaced]
        return "\n".join(lines)


def resolve_from_hf(hf_dir: Path, recipe: str, overrides: list[str]) -> FromHF:
    """The model's architecture and hyper-parameters from DIR's config.json,
    its tokenizer (when DIR has one) and checkpoint.init_from=DIR as plain
    overrides; the user's own KEY=VALUE overrides still win."""
    from megaresil.checkpoint.format import CheckpointError
    from megaresil.checkpoint.hf_io import hf_model_keys
    from megaresil.checkpoint.hf_tokenizer import check_hf_tokenizer
    from megaresil.config import parse_override, to_dict

    hf_dir = hf_dir.resolve()
    given = {parse_override(text)[0] for text in overrides}
    try:  # every file of DIR read here, before any worker: a bad one is a usage error
        model_keys, notes = hf_model_keys(hf_dir)
        tokenizer = ("data.tokenizer" not in given
                     and check_hf_tokenizer(hf_dir, model_keys["vocab_size"]))
    except CheckpointError as err:
        raise ConfigError("--from-hf", str(err)) from None
    wanted = _flat_keys("model.", model_keys)
    if tokenizer:
        wanted["data.tokenizer"] = str(hf_dir)
    wanted["checkpoint.init_from"] = str(hf_dir)
    recipe_values = _flat_keys("", to_dict(load_recipe(recipe, overrides)))
    replaced = [(key, recipe_values[key], value) for key, value in wanted.items()
                if key not in given and key in recipe_values and recipe_values[key] != value
                and key != "checkpoint.init_from"]
    hf_overrides = [f"{key}={_yaml_scalar(value)}" for key, value in wanted.items()
                    if key not in given]
    return FromHF(hf_overrides + overrides, replaced, notes)


def from_hf_overrides(hf_dir: Path, recipe: str, overrides: list[str]) -> list[str]:
    """`megaresil train RECIPE --from-hf DIR` as plain overrides (resolve_from_hf)."""
    return resolve_from_hf(hf_dir, recipe, overrides).overrides


def is_new_run(cfg: RecipeConfig) -> bool:
    """No checkpoint yet: the run starts from checkpoint.init_from, not resumes."""
    from megaresil.checkpoint.format import committed_checkpoints
    from megaresil.checkpoint.location import checkpoint_root

    return not committed_checkpoints(checkpoint_root(cfg))


def check_hf_init(cfg: RecipeConfig, from_hf: bool) -> None:
    """Before any worker starts: a new run's Hugging Face checkpoint.init_from
    describes the recipe's model (only the settings the model uses count,
    e.g. no RoPE scaling factor without scaling)."""
    from megaresil.checkpoint.hf import model_differences
    from megaresil.checkpoint.hf_io import hf_model_keys, is_hf_directory
    from megaresil.config import model_from_dict

    path = cfg.checkpoint.init_from
    if not path or not is_hf_directory(Path(path)) or not is_new_run(cfg):
        return
    differences = model_differences(model_from_dict(hf_model_keys(Path(path))[0]), cfg.model)
    if not differences:
        return
    fix = ("drop the model.* overrides that differ: --from-hf takes model.* from DIR's "
           "config.json" if from_hf else
           f"use --from-hf {path} instead of checkpoint.init_from (it takes model.* from "
           "config.json), or set model.* as config.json has it")
    raise ConfigError("model", f"checkpoint.init_from={path} holds a different model: "
                      f"{'; '.join(differences)}.", fix + ".")


def inside_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ
                                                    and "WORLD_SIZE" in os.environ)


def worker_threads(local_world: int) -> int:
    """Split the cores among local workers so 8 ranks on 2 cores don't thrash."""
    return max(1, (os.cpu_count() or 1) // local_world)


LOST_WORKER = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def lost_worker_line(record: logging.LogRecord) -> bool:
    """TorchElastic's agent logs a failed worker as a timestamped record and
    each worker it stops as another: one line of ours instead (the workers'
    own events say why)."""
    message = record.getMessage()
    found = LOST_WORKER.search(message)
    if found:
        code = int(found[1])
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        print(f"megaresil: worker process of local rank {found[2]} (pid {found[3]}) ended "
              f"with {how}", file=sys.stderr, flush=True)
        return False
    return "closing signal" not in message


def check_local_gpus(nproc: int, gpus: int) -> None:
    """On a CUDA machine each local worker owns one GPU (cuda:LOCAL_RANK): say
    so before starting them, not with "invalid device ordinal" from each."""
    if 0 < gpus < nproc:
        raise ConfigError("parallel", f"tp*pp*dp needs {nproc} local workers but this node "
                          f"sees {gpus} GPU(s) (one worker per GPU).",
                          f"lower parallel.dp/tp/pp to fit {gpus} GPU(s), or run on more nodes "
                          "with --nnodes and --rdzv-endpoint.")


def check_links(cfg: RecipeConfig) -> None:
    """A file the run writes that is a link planted in its place (metrics.jsonl
    -> /etc/passwd) would be written through, as root too: refused here,
    naming every such link, before any worker starts (safe_files). The local
    tier's default root lies in world-writable /dev/shm: it and the directory
    above it are checked too."""
    local = []
    if cfg.checkpoint.local.enabled:
        root = local_root(cfg.checkpoint.local.dir, cfg.run.dir)
        local = [root] if cfg.checkpoint.local.dir else [root.parent, root]
    refuse_links(Path(cfg.run.dir), checkpoint_root(cfg), local)


def check_data(cfg: RecipeConfig) -> None:
    """Build the recipe's datasets once here, before any worker starts: data
    too small for one sample, or a model.vocab_size below the tokenizer's, is
    a recipe error (exit 2) instead of the same failure in every worker. It
    only moves the cost: the workers find the prepared data cached."""
    from megaresil.data import build_datasets

    build_datasets(cfg.data, cfg.model.vocab_size, cfg.train.seed,
                   need_valid=cfg.train.eval_batches > 0)


def launch(recipe: str, overrides: list[str], cfg: RecipeConfig,
           membership: Membership = Membership()) -> int:
    """Run local workers under a TorchElastic agent; returns the exit code."""
    world = cfg.parallel.world_size
    nproc = membership.nproc_per_node or world
    gpus = visible_gpus()
    check_local_gpus(nproc, gpus)
    check_links(cfg)
    check_device_faults(cfg.faults, gpus)
    check_resume_recipe(cfg)
    check_fault_ranks(cfg.faults, world)
    data_started = time.monotonic()
    check_data(cfg)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    StartupPhases(EventLog(run_dir), 0, say=lambda line: print(line, file=sys.stderr)).finished(
        "data preparation", time.monotonic() - data_started)
    if warning := never_saving_warning(cfg):
        print(warning, file=sys.stderr)
    os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(nproc)))
    if membership.max_nodes == 1:  # the ranks' own sockets too, unless the user chose
        for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            os.environ.setdefault(variable, loopback_interface())
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(lost_worker_line)
    # "Received 2 death signal": the workers' own `interrupted`/`preempted` line says it better.
    logging.getLogger("torch.distributed.elastic.agent.server.api").addFilter(
        lambda record: "death signal" not in record.getMessage())
    if membership.backend == "etcd":  # it logs every step of every round, on its own handler
        from torch.distributed.elastic.rendezvous import etcd_rendezvous
        etcd_rendezvous.logger.setLevel(logging.WARNING)
    config = LaunchConfig(
        min_nodes=membership.min_nodes, max_nodes=membership.max_nodes, nproc_per_node=nproc,
        rdzv_backend=membership.backend, rdzv_endpoint=membership.rendezvous_endpoint,
        local_addr=membership.local_addr,
        # Wait 5 s (not 30) for more nodes once the minimum is there, and call
        # a node gone after ~2 s without keep-alives (not 15): a job that lost
        # a node re-forms in seconds.
        rdzv_configs={"last_call_timeout": 5, "join_timeout": 120, "keep_alive_interval": 1,
                      "keep_alive_max_attempt": 2, **membership.rdzv_conf},
        run_id=membership.run_id or f"megaresil-{os.getpid()}",
        max_restarts=cfg.resilience.max_restarts, monitor_interval=0.1,
        shutdown_timeout=int(cfg.resilience.preemption_grace_s),
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir / "elastic")),
        # SIGUSR1 too: schedulers send it as the early preemption warning
        # (Slurm's --signal=USR1@grace). The agent hands it to every worker,
        # which saves and exits; unhandled, it would kill the agent at once.
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    )
    events_before = len(read_events(run_dir))
    try:
        with (held_for_workers(run_dir, config.run_id, checkpoint_root(cfg)),
              IncidentPrinter(run_dir), second_interrupt_kills_workers(),
              elastic_stores_listening_on(config.local_addr)):
            elastic_launch(config, sys.executable)("-m", "megaresil", "train", recipe, *overrides)
    except ChildFailedError as err:
        print(f"megaresil: giving up after {relaunches_since(run_dir, events_before)}: "
              f"{failure_summary(err)}; the run directory keeps the newest checkpoint (rerun "
              "the same command to resume after fixing the cause)", file=sys.stderr)
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
    ending = last_ending(run_dir, events_before)
    if ending and ending["event"] == "run_failed":
        print(f"megaresil: giving up: rank {ending.get('rank')}: {ending.get('error')} "
              "(no restart can fix this)", file=sys.stderr)
        return 1
    return PREEMPTED_EXIT if ending and ending["event"] == "preempted" else 0


def relaunches_since(run_dir: Path, events_before: int) -> str:
    """How many times this launch relaunched the workers, said so: the
    restart budget (resilience.max_restarts) is spent when it gives up."""
    count = sum(e["event"] == "restart" and e.get("kind") == "relaunch"
                and e.get("attempt", 0) > 0  # not the one a launch after an unsaved end counts
                for e in read_events(run_dir)[events_before:])
    return f"{count} relaunch{'' if count == 1 else 'es'}"


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
    rank, failure = err.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # an error file written by @record
        message = message.get("message", "")
    first_line = next(iter(str(message).strip().splitlines()), "")
    if failure.exitcode == HANG_EXIT_CODE:
        first_line = "a hang (see the hang line above and run.dir/hangs/)"
    elif not first_line or first_line.startswith("To enable traceback"):
        first_line = "the process exited without a report"
    return f"rank {rank} ended with exit code {failure.exitcode}: {first_line[:300]}"


def rendezvous_lost(membership: Membership, err: RendezvousError) -> str:
    """Why the agents can no longer meet, and, when the c10d host is gone,
    what survives that."""
    if isinstance(err, RendezvousClosedError):  # etcd keeps a finished job's rendezvous
        return (f"the rendezvous {membership.run_id!r} at {membership.endpoint} is closed: a job "
                "with this --rdzv-id already ended; give every job (and every requeue of it) "
                "its own --rdzv-id")
    if membership.host_can_be_lost or not isinstance(err, RendezvousConnectionError):
        return f"the rendezvous at {membership.endpoint} failed: {type(err).__name__}: {err}"
    return (f"the c10d rendezvous host {membership.endpoint} is gone (the agent started with "
            "is_host=1, usually the first node, was lost), so no node can rejoin; to survive "
            "losing any node, run the rendezvous in etcd: --rdzv-backend etcd-v2 "
            "--rdzv-endpoint ETCD_HOST:PORT")


def last_ending(run_dir: Path, events_before: int) -> Optional[dict]:
    """How this launch's job ended, by the last ending event it wrote."""
    ends = [e for e in read_events(run_dir)[events_before:]
            if e["event"] in ("preempted", "interrupted", "run_finished", "run_failed")]
    return ends[-1] if ends else None


def adapt_to_world(cfg: RecipeConfig, world: int) -> RecipeConfig:
    """Elastic membership: keep tp and pp, derive dp from the world size that
    actually formed; refuse clearly when that is impossible."""
    p = cfg.parallel
    if world == p.world_size or world % (p.tp * p.pp):
        validate_world_size(cfg, world)
        return cfg
    resized = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp=world // (p.tp * p.pp)))
    try:
        validate(resized)
    except ConfigError as err:
        raise ConfigError("parallel.dp", f"the job re-formed with {world} ranks, so dp becomes "
                          f"{resized.parallel.dp}, which this recipe cannot use: {err}",
                          "choose a train.global_batch_size divisible at every world size "
                          "the job may shrink to.") from None
    return resized


def trainer_job(cfg: RecipeConfig, device: torch.device):
    """The job a worker restarts: one Trainer per generation, on a layout
    built from that generation's process groups."""
    from megaresil.parallel.layout import ParallelLayout
    from megaresil.train.loop import Trainer

    def make(supervision):
        return Trainer(cfg, ParallelLayout.from_config(cfg.parallel, device), supervision)

    return make


def slurm_task(recipe: str, overrides: list[str], cfg: RecipeConfig, step: SlurmStep) -> int:
    """One Slurm task per rank: this task is the worker; returns the exit
    code the batch script acts on (75 after a preemption save: requeue)."""
    world = cfg.parallel.world_size
    os.environ.update(step.worker_env(world))
    # torch is imported already, so the variable alone would not reach its pool.
    threads = os.environ.setdefault("OMP_NUM_THREADS", str(worker_threads(step.tasks_on_node)))
    torch.set_num_threads(int(threads))
    return PREEMPTED_EXIT if worker(recipe, overrides) == "preempted" else 0


@record
def worker(recipe: str, overrides: list[str]) -> str:
    """One rank: build the process group, train with restarts, report how it ended."""
    from megaresil.parallel.layout import pick_device
    from megaresil.resilience.watchdog import NCCL_WORKER_ENV
    from megaresil.train.precision import env_before_cuda

    end_with_agent()
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    cfg = adapt_to_world(load_recipe(recipe, overrides), world)
    for key, value in env_before_cuda(cfg.train.deterministic).items():  # CUDA has not started
        os.environ.setdefault(key, value)
    device = pick_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cfg.resilience.in_process:  # TorchElastic's 1 would kill the process on an NCCL error
            os.environ.update(NCCL_WORKER_ENV)
    if HELD_ENV not in os.environ:  # a torchrun of the user's own: no launcher checked them
        check_links(cfg)
    with held_by_worker(Path(cfg.run.dir), rank, checkpoint_root(cfg)):  # refused: the error goes to the console
        return _train_as_worker(cfg, rank, world, device)


def _train_as_worker(cfg: RecipeConfig, rank: int, world: int, device: torch.device) -> str:
    from megaresil.resilience.restart import JobFailed, run_worker
    from megaresil.resilience.watchdog import HangAbort

    try:
        return run_worker(cfg, rank, world, device, trainer_job(cfg, device))
    except JobFailed:
        if HELD_ENV not in os.environ:
            raise  # not under megaresil's launcher: the exit status must say it
        return "failed"  # exit 0: no relaunch; the launcher reports run_failed
    except (Exception, HangAbort) as err:
        # Already in events.jsonl (and on the launcher's console, one line):
        # record it for TorchElastic, but spare the console the traceback.
        get_error_handler().record_exception(err)
        sys.exit(1)
