"""The `megaresil` command."""
from __future__ import annotations

import argparse
import sys
import textwrap

from megaresil.checkpoint.format import CheckpointError
from megaresil.config import ConfigError, field_docs, load_recipe, to_yaml
from megaresil.train.checkpointing import NoValidCheckpoint

EPILOG = """examples:
  megaresil train recipes/gpt-tiny.yaml run.dir=runs/demo
  megaresil train recipes/gpt-tiny.yaml train.steps=20 model.num_layers=2
  megaresil config docs
  megaresil data prepare --source shakespeare --output data/shakespeare
"""


def cmd_train(args: argparse.Namespace) -> int:
    from megaresil.launch import inside_torchrun, launch, worker

    if inside_torchrun():
        worker(args.recipe, args.overrides)
        return 0
    cfg = load_recipe(args.recipe, args.overrides)
    return launch(args.recipe, args.overrides, cfg)


def cmd_config_show(args: argparse.Namespace) -> int:
    print(to_yaml(load_recipe(args.recipe, args.overrides)), end="")
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    for key, type_name, default, text in field_docs():
        print(f"{key}  ({type_name}, default {default})")
        print(textwrap.indent(textwrap.fill(text, 88), "    "))
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from megaresil.data.prepare import prepare_main

    prepare_main(args.source, args.output, args.tokenizer, args.vocab_size, args.valid_fraction)
    return 0


def cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from megaresil.checkpoint.inspect import format_summary, summary

    info = summary(Path(args.path))
    print(json.dumps(info, indent=1) if args.json else format_summary(info))
    return 0


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.checkpoint.inspect import verify

    reason = verify(Path(args.path))
    if reason:
        print(f"INVALID {args.path}: {reason}")
        return 1
    print(f"OK {args.path}: every shard present, checksums match")
    return 0


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/gpt-tiny.yaml")
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
    train.set_defaults(func=cmd_train)

    config = sub.add_parser("config", help="inspect recipes and the config schema")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved recipe")
    add_recipe_args(show)
    show.set_defaults(func=cmd_config_show)
    config_sub.add_parser("docs", help="list every recipe key with its type, default and "
                          "meaning").set_defaults(func=cmd_config_docs)

    ckpt = sub.add_parser("ckpt", help="inspect and verify checkpoints")
    ckpt_sub = ckpt.add_subparsers(dest="ckpt_command", required=True)
    inspect = ckpt_sub.add_parser("inspect", help="step, layout, backend, tensors, bytes per rank")
    inspect.add_argument("path", help="a checkpoint directory (e.g. RUN/checkpoints/step_0000100)")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(func=cmd_ckpt_inspect)
    verify = ckpt_sub.add_parser("verify", help="exit 0 when every shard is present and its "
                                 "checksum matches, else 1 with the reason")
    verify.add_argument("path")
    verify.set_defaults(func=cmd_ckpt_verify)

    data = sub.add_parser("data", help="prepare datasets")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser("prepare", help="tokenize a corpus into Megatron's indexed "
                                  "format (PREFIX.bin/.idx and PREFIX_valid.bin/.idx)")
    prepare.add_argument("--source", required=True,
                         help="'shakespeare', 'kjv' or a path to a UTF-8 .txt file")
    prepare.add_argument("--output", required=True, help="output prefix")
    prepare.add_argument("--tokenizer", default="bpe", choices=["bpe", "gpt2", "byte"])
    prepare.add_argument("--vocab-size", type=int, default=4096,
                         help="vocabulary of the trained BPE tokenizer")
    prepare.add_argument("--valid-fraction", type=float, default=0.02)
    prepare.set_defaults(func=cmd_data_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, NoValidCheckpoint) as err:
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 1
