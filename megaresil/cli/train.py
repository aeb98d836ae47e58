"""`megaresil train`: the launcher outside torchrun, one worker inside it."""
from __future__ import annotations

import argparse
import socket
import sys

# No torch at the top (see cli/__init__.py): each command imports what it needs.
from megaresil.cli.common import add_recipe_args
from megaresil.config import load_recipe


def cmd_train(args: argparse.Namespace) -> int:
    from megaresil.launch.standby import is_standby, wait_for_assignment

    if is_standby():  # a replacing agent's warm process: it becomes a worker, or ends
        wait_for_assignment()  # first: bound to its agent before the imports below
    from pathlib import Path

    from megaresil.launch.agent import launch
    from megaresil.launch.checks import finished_line
    from megaresil.launch.from_hf import check_hf_init, is_new_run, resolve_from_hf
    from megaresil.launch.health import excluded_before
    from megaresil.launch.membership import Membership
    from megaresil.launch.worker import inside_torchrun, slurm_task, worker
    from megaresil.slurm import SlurmStep

    overrides, from_hf = args.overrides, None
    if args.from_hf:
        from_hf = resolve_from_hf(Path(args.from_hf), args.recipe, overrides)
        overrides = from_hf.overrides
    if inside_torchrun():
        worker(args.recipe, overrides)
        return 0
    cfg = load_recipe(args.recipe, overrides)
    check_hf_init(cfg, from_hf is not None)
    # An excluded node is refused even by a finished run: its exclusion is
    # the news its operator needs, not that there is nothing left to train.
    if excluded := excluded_before(Path(cfg.run.dir), socket.gethostname()):
        print(f"megaresil: {excluded}", file=sys.stderr)
        return 1
    if finished := finished_line(cfg):  # before any worker starts, or writes to the run
        print(f"megaresil: {finished}", file=sys.stderr)
        return 0
    if from_hf and is_new_run(cfg) and from_hf.report():
        print(from_hf.report(), file=sys.stderr)  # once per run: a resume does not repeat it
    step = SlurmStep.from_environ()
    if step is not None and step.one_task_per_rank:
        return slurm_task(args.recipe, overrides, cfg, step)
    if step is not None and not args.nnodes:
        world = cfg.parallel.world_size
        membership = Membership.for_slurm(step, world, args.nproc_per_node, args.rdzv_backend,
                                          args.rdzv_endpoint)
    else:
        membership = Membership.parse(args.nnodes, args.nproc_per_node, args.rdzv_endpoint,
                                      args.rdzv_id, args.rdzv_conf or "", args.rdzv_backend,
                                      args.local_addr, args.spares)
    return launch(args.recipe, overrides, cfg, membership)


def add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="train a recipe (launches tp*pp*dp local workers "
                           "through TorchElastic; inside torchrun, runs as one worker)")
    add_recipe_args(train)
    train.add_argument("--from-hf", metavar="DIR",
                       help="start from a Hugging Face model directory's weights: model.* "
                            "from its config.json, data.tokenizer from its tokenizer, "
                            "checkpoint.init_from=DIR (fresh optimizer, step 0); a run that "
                            "already has checkpoints resumes from them instead")
    train.add_argument("--nnodes", metavar="MIN:MAX",
                       help="elastic membership: agents (nodes) that form the job; when one "
                            "is lost the rest re-form with dp shrunk (tp and pp kept)")
    train.add_argument("--spares", type=int, default=0, metavar="N",
                       help="hot spares (with --nnodes): N more agents may join and wait, "
                            "starting no workers; when a node is lost one takes its place and "
                            "dp does not shrink. A MAX above the nodes the layout trains on "
                            "makes spares of the extra nodes too")
    train.add_argument("--nproc-per-node", type=int,
                       help="workers per agent (default: tp*pp*dp on one node)")
    train.add_argument("--rdzv-backend", default="c10d", choices=("c10d", "etcd", "etcd-v2"),
                       help="where the agents meet (with --nnodes): c10d (default) in a store "
                            "hosted by one agent, which must outlive the others; etcd-v2 or "
                            "etcd in an etcd server (--enable-v2), so any node may be lost")
    train.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="rendezvous endpoint shared by all agents (with --nnodes): the "
                            "c10d host agent's, or the etcd server's")
    train.add_argument("--rdzv-id", help="job id shared by all agents (with --nnodes)")
    train.add_argument("--rdzv-conf", metavar="KEY=VALUE,...",
                       help="rendezvous options, e.g. is_host=1 on the agent that hosts the "
                            "rendezvous store (it must outlive the others)")
    train.add_argument("--local-addr", metavar="ADDRESS",
                       help="this node's address, where its stores listen and that its workers "
                            "get as MASTER_ADDR (default: 127.0.0.1 on one node; with --nnodes, "
                            "its address on the interface that reaches --rdzv-endpoint)")
    train.set_defaults(func=cmd_train, overrides_anywhere=True)
