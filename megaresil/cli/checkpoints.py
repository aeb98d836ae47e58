"""`megaresil ckpt inspect|verify|diff` and `megaresil convert`."""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from megaresil.cli.common import checkpoint_argument

if TYPE_CHECKING:
    from pathlib import Path

    from megaresil.checkpoint.offline.convert import Target


def cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from megaresil.checkpoint.megatron.directory import is_megatron_checkpoint

    if is_megatron_checkpoint(Path(args.path)):
        from megaresil.checkpoint.megatron import inspection
        info = inspection.summary(Path(args.path))
        text = inspection.format_summary(info, args.tensors)
    else:
        from megaresil.checkpoint.offline import inspect
        info = inspect.summary(checkpoint_argument(args.path))
        text = inspect.format_summary(info, args.tensors)
    print(json.dumps(info, indent=1) if args.json else text)
    return 0


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.checkpoint.megatron.directory import is_megatron_checkpoint
    from megaresil.checkpoint.offline.inspect import verify

    if is_megatron_checkpoint(Path(args.path)):
        from megaresil.checkpoint.megatron import inspection
        valid, said = inspection.verify(Path(args.path))
        print(f"{'OK' if valid else 'INVALID'} {args.path}: {said}")
        return 0 if valid else 1
    path = checkpoint_argument(args.path)
    reason = verify(path)
    if reason:
        print(f"INVALID {path}: {reason}")
        return 1
    print(f"OK {path}: every shard present, checksums match")
    return 0


def _convert_target(args: argparse.Namespace) -> Target:
    from megaresil.checkpoint.offline.convert import Target

    distributed = None if args.distributed_optimizer is None else args.distributed_optimizer == "on"
    return Target(tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp, ep=args.ep, cp=args.cp,
                  dp_shard=args.dp_shard, distributed_optimizer=distributed, backend=args.backend,
                  weights_only=args.weights_only, overrides=args.set)


def _convert_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Path]:
    """The positional paths, checked against the form in use."""
    from pathlib import Path

    paths = [Path(p) for p in args.paths]
    if sum(bool(form) for form in (args.to_hf, args.from_hf, args.from_megatron,
                                   args.to_megatron)) > 1:
        parser.error("give one of --to-hf, --from-hf, --from-megatron and --to-megatron")
    expected, form = ((1, "convert SRC --to-hf DIR") if args.to_hf else
                      (1, "convert --from-hf DIR DST") if args.from_hf else
                      (1, "convert --from-megatron SRC DST") if args.from_megatron else
                      (1, "convert SRC --to-megatron DIR") if args.to_megatron else
                      (2, "convert SRC DST"))
    if len(paths) != expected:
        parser.error(f"expected {form}; got {len(paths)} path(s)")
    if args.recipe and not (args.from_hf or args.from_megatron):
        parser.error("--recipe applies to --from-hf and --from-megatron only (a checkpoint "
                     "carries its recipe)")
    layout_options = [args.tp, args.pp, args.dp, args.vpp, args.ep, args.cp, args.dp_shard,
                      args.distributed_optimizer,
                      args.backend, args.weights_only or None, args.set or None]
    if args.to_hf and any(option is not None for option in layout_options):
        parser.error("--to-hf exports the weights alone: layout, backend, --weights-only and "
                     "--set do not apply")
    if args.to_megatron and any(option is not None for option in layout_options):
        parser.error("--to-megatron exports the weights alone at tp=1, pp=1 (Megatron reshards "
                     "on load): layout, backend, --weights-only and --set do not apply")
    export_options = [None if args.from_megatron else args.tokenizer, args.max_shard_size,
                      None if args.to_megatron else args.dtype]
    if not args.to_hf and any(option is not None for option in export_options):
        parser.error("--tokenizer applies to --to-hf and --from-megatron, --max-shard-size "
                     "to --to-hf only, --dtype to --to-hf and --to-megatron")
    return paths


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.checkpoint.hf.io import export_to_hf, import_from_hf, parse_size
    from megaresil.checkpoint.offline.convert import convert

    paths = _convert_paths(args.parser, args)
    if args.to_hf:
        try:
            shard_bytes = parse_size(args.max_shard_size or "5GB")
        except ValueError as err:
            args.parser.error(f"--max-shard-size: {err}")
        written = export_to_hf(checkpoint_argument(str(paths[0])), Path(args.to_hf), overwrite=args.overwrite,
                               tokenizer=args.tokenizer, max_shard_bytes=shard_bytes,
                               dtype=args.dtype)
    elif args.to_megatron:
        from megaresil.checkpoint.megatron.writing import export_to_megatron

        written = export_to_megatron(checkpoint_argument(str(paths[0])), Path(args.to_megatron),
                                     overwrite=args.overwrite, dtype=args.dtype)
    elif args.from_megatron:
        from megaresil.checkpoint.megatron.reading import import_from_megatron

        written = import_from_megatron(Path(args.from_megatron), paths[0], _convert_target(args),
                                       recipe=Path(args.recipe) if args.recipe else None,
                                       tokenizer=args.tokenizer, overwrite=args.overwrite)
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
    from megaresil.checkpoint.offline.diff import diff_checkpoints, format_report

    tolerant = args.atol is not None or args.rtol is not None
    report = diff_checkpoints(checkpoint_argument(args.a), checkpoint_argument(args.b),
                              atol=args.atol or 0.0,
                              rtol=args.rtol or 0.0)
    print(format_report(report, (args.atol or 0.0, args.rtol or 0.0) if tolerant else None))
    return 0 if report.within else 1


def add_ckpt_parser(sub) -> None:
    ckpt = sub.add_parser("ckpt", help="inspect and verify checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    where = ("a checkpoint directory, a run directory, its checkpoints/ or checkpoints/latest "
             "(the newest valid checkpoint, named on stderr), or a Megatron save directory")
    inspect = ckpt_sub.add_parser("inspect", help="a summary: step, layout, backend, parameters, "
                                  "model, tensors count, bytes per rank (--tensors: each tensor)")
    inspect.add_argument("path", help=where)
    inspect.add_argument("--tensors", action="store_true", help="also list every tensor")
    inspect.add_argument("--json", action="store_true", help="machine-readable output (every "
                         "tensor included)")
    inspect.set_defaults(func=cmd_ckpt_inspect)
    verify = ckpt_sub.add_parser("verify", help="exit 0 when every shard is present and its "
                                 "checksum matches, else 1 with the reason (a Megatron "
                                 "checkpoint, which has no checksums: every tensor read whole "
                                 "and finite)")
    verify.add_argument("path", help=where)
    verify.set_defaults(func=cmd_ckpt_verify)
    diff = ckpt_sub.add_parser("diff", help="compare two checkpoints tensor by tensor, whatever "
                               "their layouts; exit 0 when identical (or within --atol/--rtol)")
    diff.add_argument("a", metavar="A", help=where)
    diff.add_argument("b", metavar="B", help="the same, for the other checkpoint")
    diff.add_argument("--atol", type=float, help="absolute tolerance (as torch.allclose)")
    diff.add_argument("--rtol", type=float, help="relative tolerance (as torch.allclose)")
    diff.set_defaults(func=cmd_ckpt_diff)


def add_convert_parser(sub) -> None:
    convert = sub.add_parser(
        "convert", help="convert a checkpoint to another layout or backend, or to/from Hugging "
        "Face (single process)",
        description="megaresil convert SRC DST [layout options]  |  megaresil convert SRC --to-hf "
        "DIR  |  megaresil convert --from-hf DIR DST [layout options] [--recipe RECIPE]  |  "
        "megaresil convert --from-megatron SRC DST [layout options] [--recipe RECIPE] "
        "[--tokenizer SPEC]  |  megaresil convert SRC --to-megatron DIR. "
        "Unset options keep the source's value.")
    convert.add_argument("paths", nargs="*", metavar="PATH", help="SRC DST, SRC (--to-hf, "
                         "--to-megatron) or DST (--from-hf, --from-megatron); SRC may be a run "
                         "directory, its checkpoints/ or "
                         "checkpoints/latest (the newest valid checkpoint)")
    for name in ("tp", "pp", "dp", "vpp", "ep", "cp", "dp_shard"):
        convert.add_argument(f"--{name.replace('_', '-')}", type=int,
                             help=f"target parallel.{name}")
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
                         "default: the recipe's data.tokenizer. With --from-megatron: the "
                         "tokenizer to record; default: Megatron-LM's args' when megaresil "
                         "reads it")
    convert.add_argument("--max-shard-size", metavar="SIZE", help="with --to-hf: largest "
                         "safetensors file (e.g. 5GB, the default); more weights are split into "
                         "shards with model.safetensors.index.json")
    convert.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                         help="with --to-hf or --to-megatron: the exported weights' dtype "
                         "(default: as stored, float32)")
    convert.add_argument("--from-hf", metavar="DIR", help="import a transformers GPT-2, Llama, "
                         "Mixtral or Qwen3-MoE model directory as a weights-only checkpoint")
    convert.add_argument("--from-megatron", metavar="SRC", help="import a Megatron-LM / "
                         "Megatron-Core torch_dist checkpoint (a save directory or one iter_* "
                         "directory; gpt2, llama, qwen2, qwen3 or their mixtures of experts): "
                         "with its optimizer state when "
                         "Megatron saved it in model space (fully_reshardable), else weights only")
    convert.add_argument("--recipe", help="with --from-hf or --from-megatron: training keys from "
                         "this recipe (default: the schema defaults); model.* comes from "
                         "config.json or Megatron-LM's args, from the recipe when there are none")
    convert.add_argument("--to-megatron", metavar="DIR", help="export the weights as a "
                         "Megatron-LM checkpoint directory (--load DIR): torch_dist at tp=1, "
                         "pp=1, Megatron-Core's keys, args and latest_checkpointed_iteration.txt")
    convert.set_defaults(func=cmd_convert, parser=convert)


