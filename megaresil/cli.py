"""The `megaresil` command."""
from __future__ import annotations

import argparse
import sys
import textwrap
from typing import TYPE_CHECKING

# Nothing that imports torch at the top: --help, config, recipes answer in a
# fraction of a second (each command imports what it needs).
from megaresil.config import (ConfigError, field_docs, find_recipe, load_recipe,
                              packaged_recipes, to_yaml)

if TYPE_CHECKING:
    from pathlib import Path

    from megaresil.checkpoint.convert import Target

EPILOG = """examples:
  megaresil recipes
  megaresil train gpt-tiny train.steps=20
  megaresil train recipes/gpt-tiny.yaml run.dir=runs/demo
  megaresil train recipes/gpt-tiny.yaml train.steps=20 model.num_layers=2
  megaresil train recipes/llama-3.2-1b.yaml --from-hf models/Llama-3.2-1B
  megaresil config docs
  megaresil data prepare --input corpus.jsonl --json-key text --output data/corpus
  megaresil report runs/demo --compare runs/other
  megaresil eval runs/demo --split test
  megaresil generate runs/demo --prompt "ROMEO:" --max-new-tokens 40
  megaresil ckpt inspect runs/demo
"""


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.launch import (Membership, check_hf_init, inside_torchrun, is_new_run,
                                  launch, resolve_from_hf, slurm_task, worker)
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
                                      args.local_addr)
    return launch(args.recipe, overrides, cfg, membership)


def cmd_config_show(args: argparse.Namespace) -> int:
    overrides = args.overrides
    if args.from_hf:  # what `train RECIPE --from-hf DIR` would run, without running it
        from pathlib import Path

        from megaresil.launch import check_hf_init, resolve_from_hf

        from_hf = resolve_from_hf(Path(args.from_hf), args.recipe, overrides)
        overrides = from_hf.overrides
        if from_hf.report():
            print(from_hf.report(), file=sys.stderr)
    cfg = load_recipe(args.recipe, overrides)
    if args.from_hf:
        check_hf_init(cfg, from_hf=True)
    print(to_yaml(cfg), end="")
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    for key, type_name, default, text in field_docs():
        print(f"{key}  ({type_name}, default {default})")
        print(textwrap.indent(textwrap.fill(text, 88), "    "))
    return 0


def cmd_recipes(args: argparse.Namespace) -> int:
    recipes = packaged_recipes()
    width = max(len(name) for name, _ in recipes)
    for name, header in recipes:
        print(f"{name:<{width}}  {header}")
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from megaresil.data.prepare import prepare_main

    if args.tokenizer is None:  # say so: a new BPE is a choice the user did not make
        print(f"tokenizer: none given (--tokenizer), so a new BPE of {args.vocab_size} tokens "
              f"is trained on the input and saved as {args.output}_tokenizer.json (what "
              f"data.tokenizer=bpe data.path={args.output} reads)")
    prepare_main(args.input, args.output, args.tokenizer or "bpe", json_key=args.json_key,
                 workers=args.workers, vocab_size=args.vocab_size,
                 max_record_bytes=args.max_record_bytes)
    return 0


def checkpoint_argument(path: str) -> Path:
    """The checkpoint a run directory, checkpoint root or `latest` means,
    said on stderr (stdout stays the command's, e.g. --json)."""
    from pathlib import Path

    from megaresil.checkpoint.location import resolve_checkpoint

    resolved, note = resolve_checkpoint(Path(path))
    if note:
        print(note, file=sys.stderr)
    return resolved


def cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    import json

    from megaresil.checkpoint.inspect import format_summary, summary

    info = summary(checkpoint_argument(args.path))
    print(json.dumps(info, indent=1) if args.json else format_summary(info, args.tensors))
    return 0


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from megaresil.checkpoint.inspect import verify

    path = checkpoint_argument(args.path)
    reason = verify(path)
    if reason:
        print(f"INVALID {path}: {reason}")
        return 1
    print(f"OK {path}: every shard present, checksums match")
    return 0


def _convert_target(args: argparse.Namespace) -> Target:
    from megaresil.checkpoint.convert import Target

    distributed = None if args.distributed_optimizer is None else args.distributed_optimizer == "on"
    return Target(tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp,
                  distributed_optimizer=distributed, backend=args.backend,
                  weights_only=args.weights_only, overrides=args.set)


def _convert_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Path]:
    """The positional paths, checked against the form in use."""
    from pathlib import Path

    paths = [Path(p) for p in args.paths]
    if args.to_hf and args.from_hf:
        parser.error("give either --to-hf or --from-hf, not both")
    expected, form = ((1, "convert SRC --to-hf DIR") if args.to_hf else
                      (1, "convert --from-hf DIR DST") if args.from_hf else
                      (2, "convert SRC DST"))
    if len(paths) != expected:
        parser.error(f"expected {form}; got {len(paths)} path(s)")
    if args.recipe and not args.from_hf:
        parser.error("--recipe applies to --from-hf only (a checkpoint carries its recipe)")
    layout_options = [args.tp, args.pp, args.dp, args.vpp, args.distributed_optimizer,
                      args.backend, args.weights_only or None, args.set or None]
    if args.to_hf and any(option is not None for option in layout_options):
        parser.error("--to-hf exports the weights alone: layout, backend, --weights-only and "
                     "--set do not apply")
    export_options = [args.tokenizer, args.max_shard_size, args.dtype]
    if not args.to_hf and any(option is not None for option in export_options):
        parser.error("--tokenizer, --max-shard-size and --dtype apply to --to-hf only")
    return paths


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.checkpoint.convert import convert
    from megaresil.checkpoint.hf_io import export_to_hf, import_from_hf, parse_size

    paths = _convert_paths(args.parser, args)
    if args.to_hf:
        try:
            shard_bytes = parse_size(args.max_shard_size or "5GB")
        except ValueError as err:
            args.parser.error(f"--max-shard-size: {err}")
        written = export_to_hf(checkpoint_argument(str(paths[0])), Path(args.to_hf), overwrite=args.overwrite,
                               tokenizer=args.tokenizer, max_shard_bytes=shard_bytes,
                               dtype=args.dtype)
    elif args.from_hf:
        written = import_from_hf(Path(args.from_hf), paths[0], _convert_target(args),
                                 recipe=Path(args.recipe) if args.recipe else None,
                                 overwrite=args.overwrite)
    else:
        written = convert(checkpoint_argument(str(paths[0])), paths[1], _convert_target(args),
                          overwrite=args.overwrite)
    print(f"wrote {written}")
    return 0


def cmd_ckpt_diff(args: argparse.Namespace) -> int:
    from megaresil.checkpoint.diff import diff_checkpoints, format_report

    tolerant = args.atol is not None or args.rtol is not None
    report = diff_checkpoints(checkpoint_argument(args.a), checkpoint_argument(args.b),
                              atol=args.atol or 0.0,
                              rtol=args.rtol or 0.0)
    print(format_report(report, (args.atol or 0.0, args.rtol or 0.0) if tolerant else None))
    return 0 if report.within else 1


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    from dataclasses import replace
    from pathlib import Path

    from megaresil.plan.profile import job_kinds, load_profile
    from megaresil.plan.report import Scale, format_plan, plan, read_run_costs, trace_kinds

    profile = load_profile(args.profile) if args.profile else load_profile()
    kinds = job_kinds(profile, args.gpus)
    if args.failure_trace:
        kinds = trace_kinds(Path(args.failure_trace))
    elif args.mtbf_hours:  # the profile's mix of kinds, at this MTBF per GPU
        factor = args.gpus / (args.mtbf_hours * 3600) / sum(k.per_s for k in kinds)
        kinds = [replace(k, per_s=k.per_s * factor) for k in kinds]
    scale = (Scale(args.state_bytes, args.gpus, args.storage_gbps * 1e9)
             if args.state_bytes else None)
    try:
        costs = read_run_costs(Path(args.run_dir))
        report = plan(costs, kinds, replacement_s=(args.replacement_s if args.replacement_s
                                                   is not None else
                                                   profile.get("node_replacement_extra_s", 0.0)),
                      scale=scale, step_s=args.step_s,
                      simulate_days=args.days if args.simulate else None, seed=args.seed)
    except ValueError as err:  # a run that cannot be planned from: say why, no traceback
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 2
    report["costs"] = costs.to_dict()
    print(json.dumps(report, indent=1) if args.json else format_plan(report))
    return 0


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="the checkpoint interval and goodput to expect at scale, "
                       "from a run's measured costs (and --simulate: a simulated long run)",
                       description="Failures: --mtbf-hours (per GPU, with the profile's mix of "
                       "kinds), or --failure-trace, else the profile's own rates (default: "
                       "Llama 3 405B's, megaresil/plan/profiles/llama3_405b.yaml).")
    p.add_argument("run_dir", help="a run directory (or a JSON written by plan --json)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--mtbf-hours", type=float, help="mean time between failures of one GPU")
    p.add_argument("--failure-trace", help='JSON lines {"hours": T, "path": in_process|'
                   'relaunch|node_replacement}')
    p.add_argument("--profile", help="failure profile YAML")
    p.add_argument("--replacement-s", type=float,
                   help="seconds a spare host takes to replace a failed one (default: the "
                        "profile's)")
    p.add_argument("--state-bytes", type=float, help="scale save and load costs to this "
                   "checkpoint size, spread over --gpus ranks")
    p.add_argument("--storage-gbps", type=float, default=2000.0,
                   help="aggregate storage GB/s that bounds a scaled save and load")
    p.add_argument("--step-s", type=float, help="step time (default: the run's)")
    p.add_argument("--simulate", action="store_true", help="also simulate each policy")
    p.add_argument("--days", type=float, default=54.0, help="simulated days of work")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def add_convert_parser(sub) -> None:
    convert = sub.add_parser(
        "convert", help="convert a checkpoint to another layout or backend, or to/from Hugging "
        "Face (single process)",
        description="megaresil convert SRC DST [layout options]  |  megaresil convert SRC --to-hf "
        "DIR  |  megaresil convert --from-hf DIR DST [layout options] [--recipe RECIPE]. "
        "Unset options keep the source's value.")
    convert.add_argument("paths", nargs="*", metavar="PATH", help="SRC DST, SRC (--to-hf) or DST "
                         "(--from-hf); SRC may be a run directory, its checkpoints/ or "
                         "checkpoints/latest (the newest valid checkpoint)")
    for name in ("tp", "pp", "dp", "vpp"):
        convert.add_argument(f"--{name}", type=int, help=f"target parallel.{name}")
    convert.add_argument("--distributed-optimizer", choices=["on", "off"],
                         help="target optimizer.distributed (moments as DP row shards)")
    convert.add_argument("--backend", choices=["torch_dist", "zarr"], help="target backend")
    convert.add_argument("--weights-only", action="store_true",
                         help="drop the optimizer state (the result cannot resume training)")
    convert.add_argument("--overwrite", action="store_true", help="replace an existing "
                         "destination, once the new one is complete")
    convert.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="other recipe overrides, e.g. train.global_batch_size=32 "
                         "(repeatable)")
    convert.add_argument("--to-hf", metavar="DIR", help="export the weights as a transformers "
                         "model directory (config.json, safetensors weights, tokenizer files)")
    convert.add_argument("--tokenizer", metavar="SPEC", help="with --to-hf: the tokenizer to "
                         "write (a tokenizer.json, a model directory, gpt2, bpe or byte); "
                         "default: the recipe's data.tokenizer")
    convert.add_argument("--max-shard-size", metavar="SIZE", help="with --to-hf: largest "
                         "safetensors file (e.g. 5GB, the default); more weights are split into "
                         "shards with model.safetensors.index.json")
    convert.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                         help="with --to-hf: the exported weights' dtype (default: as stored, "
                         "float32)")
    convert.add_argument("--from-hf", metavar="DIR", help="import a transformers GPT-2 or Llama "
                         "model directory as a weights-only checkpoint")
    convert.add_argument("--recipe", help="with --from-hf: training keys from this recipe "
                         "(default: the schema defaults); model.* comes from config.json")
    convert.set_defaults(func=cmd_convert, parser=convert)


# The names of resilience.chaos.scenarios(), listed here so `chaos --help` need
# not import the chaos machinery (a test keeps the two equal).
CHAOS_SCENARIOS = ("kill-rank", "raise-in-rank", "hang-in-collective", "hang-outside-collective",
                   "hang-holding-gil", "hang-in-native-code", "hang-on-device", "slow-rank",
                   "sigterm", "corrupt-latest-checkpoint", "kill-during-checkpoint-save",
                   "node-loss", "node-loss-first", "kill-rank-local", "node-loss-local")


def cmd_chaos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.resilience.chaos import Rendezvous, format_result, run_scenario

    result = run_scenario(args.recipe, args.overrides, args.scenario,
                          reference=Path(args.reference) if args.reference else None,
                          rank=args.rank, step=args.step,
                          rendezvous=Rendezvous(args.rdzv_backend, args.rdzv_endpoint),
                          timeout_s=args.timeout)
    print(format_result(result))
    ok = result["recovered"] and result["final_loss_equal"]
    return 0 if ok else 1


def cmd_soak(args: argparse.Namespace) -> int:
    from megaresil.resilience.soak import format_report, run_soak

    report = run_soak(args.recipe, args.overrides, minutes=args.minutes, seed=args.seed,
                      hogs=args.hogs, local=args.local_tier)
    print(format_report(report))
    return 0 if report["ok"] else 1


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.observe.report import write_report
    from megaresil.safe_files import LinkRefused

    try:
        page = write_report(Path(args.run_dir), [Path(p) for p in args.compare],
                            Path(args.out) if args.out else None)
    except LinkRefused as err:  # a planted report/ link: refused, not followed
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {page} (and its PNGs beside it)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from megaresil.inference import evaluate

    result = evaluate(checkpoint_argument(args.path), args.batches, args.split, tp=args.tp)
    print(json.dumps(result) if args.json else
          f"step {result['step']}: {result['split']} loss {result['loss']:.4f}, perplexity "
          f"{result['perplexity']:.2f} ({result['batches']} batches, {result['checkpoint']})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import json

    from megaresil.inference import generate

    result = generate(checkpoint_argument(args.path), args.prompt,
                      max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                      tp=args.tp)
    print(json.dumps(result) if args.json else args.prompt + result["completion"])
    return 0


TP_HELP = ("tensor-parallel processes holding the model (default 1: one process); one per GPU "
           "for a model too big for one")


def add_checkpoint_use_parsers(sub) -> None:
    evaluate = sub.add_parser("eval", help="loss and perplexity of a checkpoint on the held-out "
                              "split (the run's own eval batches), in one process (or --tp N)")
    evaluate.add_argument("path", metavar="CKPT|RUN_DIR", help="a checkpoint, or a run "
                          "directory (its newest checkpoint)")
    evaluate.add_argument("--batches", type=int, help="global batches (default: the run's "
                          "train.eval_batches)")
    evaluate.add_argument("--split", choices=("valid", "test"), default="valid",
                          help="valid (the default: the run's own eval batches) or test (held "
                          "out from both training and eval; how it is carved: data/build.py)")
    evaluate.add_argument("--json", action="store_true")
    evaluate.add_argument("--tp", type=int, default=1, help=TP_HELP)
    evaluate.set_defaults(func=cmd_eval)
    gen = sub.add_parser("generate", help="continue a prompt with a checkpoint's model, in "
                         "one process (or --tp N)")
    gen.add_argument("path", metavar="CKPT|RUN_DIR", help="a checkpoint, or a run directory "
                     "(its newest checkpoint)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    gen.add_argument("--top-k", type=int, help="sample among the k likeliest tokens only")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    gen.add_argument("--json", action="store_true", help="also the token ids")
    gen.add_argument("--tp", type=int, default=1, help=TP_HELP)
    gen.set_defaults(func=cmd_generate)


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML or a packaged recipe's name, e.g. "
                        "gpt-tiny (`megaresil recipes` lists them)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="recipe overrides; values are YAML (parallel.tp=2, "
                             "faults='[{kind: kill, rank: 1, step: 7}]')")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megaresil", description="3D-parallel GPT training with resiliency built in.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    chaos = sub.add_parser("chaos", help="run a fault scenario beside a fault-free reference "
                           "and report detection latency, restart time, steps lost and "
                           "whether the final loss matches")
    add_recipe_args(chaos)
    chaos.add_argument("--scenario", required=True, choices=CHAOS_SCENARIOS, metavar="NAME",
                       help="one of: " + ", ".join(CHAOS_SCENARIOS) + " (hang-on-device needs "
                            "CUDA; node-loss-first loses the node that started first, the c10d "
                            "host; the -local ones use the local checkpoint tier)")
    chaos.add_argument("--rank", type=int, help="faulty rank (default: the last)")
    chaos.add_argument("--step", type=int, help="fault step (default: train.steps/2 + 1)")
    chaos.add_argument("--reference", help="reuse this fault-free run directory as the reference")
    chaos.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                       help="stop the faulted run after this long and report it unrecovered "
                            "(exit code 124; default 900)")
    chaos.add_argument("--rdzv-backend", default="c10d", choices=("c10d", "etcd", "etcd-v2"),
                       help="where the node-loss scenarios' agents meet (etcd needs "
                            "--rdzv-endpoint ETCD_HOST:PORT)")
    chaos.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="the etcd server of --rdzv-backend etcd or etcd-v2")
    chaos.set_defaults(func=cmd_chaos, overrides_anywhere=True)

    soak = sub.add_parser("soak", help="one long run with faults of every kind at random steps "
                          "and sections (async saves, optional CPU hogs), then a fault-free "
                          "reference; exit 0 when every fault was recovered, no false alarm "
                          "was raised and the final state is bit-equal",
                          description="Writes calibration/, faulted/, reference/ and soak.json "
                          "under run.dir.")
    add_recipe_args(soak)
    soak.add_argument("--minutes", type=float, required=True,
                      help="wall-time budget of the faulted run; steps and faults are fitted "
                           "to it from a short calibration run (the calibration and the "
                           "reference come on top)")
    soak.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    soak.add_argument("--hogs", type=int, default=0,
                      help="busy CPU processes beside the calibration and faulted runs")
    soak.add_argument("--no-local-tier", dest="local_tier", action="store_false",
                      help="global checkpoints only (by default the soak saves to the local "
                           "tier every step on two simulated nodes and damages it too)")
    soak.set_defaults(func=cmd_soak, overrides_anywhere=True)

    report = sub.add_parser("report", help="an HTML page with PNGs of a run: loss/eval "
                            "curves, throughput and MFU, a timeline of restarts, checkpoints "
                            "and faults, a per-rank straggler heat map, the goodput breakdown",
                            description="Writes RUN_DIR/report/index.html (images inlined), "
                            "one PNG per panel and summary.json.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (run.dir)")
    report.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR",
                        help="more runs to overlay (e.g. a reference, other layouts)")
    report.add_argument("--out", help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)

    add_plan_parser(sub)

    sub.add_parser("recipes", help="list the packaged recipes (train one by name: "
                   "megaresil train gpt-tiny)").set_defaults(func=cmd_recipes)

    config = sub.add_parser("config", help="inspect recipes and the config schema")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved recipe")
    add_recipe_args(show)
    show.add_argument("--from-hf", metavar="DIR", help="as `train RECIPE --from-hf DIR` would "
                      "resolve it (a dry run: nothing starts)")
    show.set_defaults(func=cmd_config_show, overrides_anywhere=True)
    config_sub.add_parser("docs", help="list every recipe key with its type, default and "
                          "meaning").set_defaults(func=cmd_config_docs)

    ckpt = sub.add_parser("ckpt", help="inspect and verify checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    where = ("a checkpoint directory, a run directory, its checkpoints/ or checkpoints/latest "
             "(the newest valid checkpoint, named on stderr)")
    inspect = ckpt_sub.add_parser("inspect", help="a summary: step, layout, backend, parameters, "
                                  "model, tensors count, bytes per rank (--tensors: each tensor)")
    inspect.add_argument("path", help=where)
    inspect.add_argument("--tensors", action="store_true", help="also list every tensor")
    inspect.add_argument("--json", action="store_true", help="machine-readable output (every "
                         "tensor included)")
    inspect.set_defaults(func=cmd_ckpt_inspect)
    verify = ckpt_sub.add_parser("verify", help="exit 0 when every shard is present and its "
                                 "checksum matches, else 1 with the reason")
    verify.add_argument("path", help=where)
    verify.set_defaults(func=cmd_ckpt_verify)
    diff = ckpt_sub.add_parser("diff", help="compare two checkpoints tensor by tensor, whatever "
                               "their layouts; exit 0 when identical (or within --atol/--rtol)")
    diff.add_argument("a", metavar="A", help=where)
    diff.add_argument("b", metavar="B", help="the same, for the other checkpoint")
    diff.add_argument("--atol", type=float, help="absolute tolerance (as torch.allclose)")
    diff.add_argument("--rtol", type=float, help="relative tolerance (as torch.allclose)")
    diff.set_defaults(func=cmd_ckpt_diff)

    add_convert_parser(sub)
    add_checkpoint_use_parsers(sub)

    data = sub.add_parser("data", help="prepare datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser(
        "prepare", help="tokenize text or JSON Lines files into one Megatron indexed dataset "
        "(PREFIX.bin/.idx), streaming, in parallel worker processes",
        description="Every document is followed by the tokenizer's end-of-document token. "
        "Training splits the result into train/valid/test by data.split.")
    prepare.add_argument("--input", "--source", dest="input", nargs="+", required=True,
                         metavar="FILE", help="text files (documents separated by two blank "
                         "lines), JSON Lines files (.jsonl/.json, or any with --json-key), or "
                         "the corpus names shakespeare/kjv; read in the order given")
    prepare.add_argument("--output", required=True, help="output prefix")
    prepare.add_argument("--json-key", help="field of each JSON line that holds the text "
                         "(default for .jsonl/.json files: text)")
    prepare.add_argument("--tokenizer",
                         help="bpe (the default: trained on the input, saved as PREFIX_tokenizer.json), gpt2, "
                         "byte, or a Hugging Face tokenizer.json or model directory")
    prepare.add_argument("--vocab-size", type=int, default=4096,
                         help="vocabulary of the trained BPE tokenizer")
    prepare.add_argument("--workers", type=int, help="tokenizer processes (default: the CPU "
                         "count, at most 8)")
    prepare.add_argument("--max-record-bytes", type=int, metavar="N",
                         help="refuse a JSON Lines record (line) longer than N bytes (default "
                         "4 MiB): tokenizing one with a BPE takes up to ~180x its size in memory")
    prepare.set_defaults(func=cmd_data_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `megaresil soak|chaos RECIPE --opt V KEY=VALUE ...`: overrides after the options too.
    if extra and not (getattr(args, "overrides_anywhere", False)
                      and all("=" in a and not a.startswith("-") for a in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides += extra
    try:
        if getattr(args, "recipe", None):
            args.recipe = str(find_recipe(args.recipe))
        return args.func(args)
    except ConfigError as err:
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        from megaresil.checkpoint.format import CheckpointError
        from megaresil.checkpoint.location import NoValidCheckpoint

        if not isinstance(err, (CheckpointError, NoValidCheckpoint)):
            raise
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 1
