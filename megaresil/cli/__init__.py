"""The `megaresil` command: the parser and `main`; each family of commands
(and its part of the parser) lives in a module of its own."""
from __future__ import annotations

import argparse
import os
import signal
import sys

# Nothing that imports torch at the top: --help, config, recipes answer in a
# fraction of a second (each command imports what it needs).
from megaresil.cli.checkpoints import add_ckpt_parser, add_convert_parser
from megaresil.cli.drills import add_chaos_parser, add_soak_parser
from megaresil.cli.inference import add_checkpoint_use_parsers
from megaresil.cli.plan import add_plan_parser, add_report_parser
from megaresil.cli.recipes import add_config_parser, add_data_parser, add_recipes_parser
from megaresil.cli.train import add_train_parser
from megaresil.config import find_recipe
from megaresil.errors import MegaresilError

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megaresil", description="3D-parallel GPT training with resiliency built in.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (add_train_parser, add_chaos_parser, add_soak_parser, add_report_parser,
                add_plan_parser, add_recipes_parser, add_config_parser, add_ckpt_parser,
                add_convert_parser, add_checkpoint_use_parsers, add_data_parser):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return run_command(argv)
    except BrokenPipeError:
        # `megaresil config docs | head`: the reader left. Exit as a process
        # killed by SIGPIPE would, without a traceback; stdout goes to devnull
        # so the interpreter's flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def run_command(argv: list[str] | None) -> int:
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
    except MegaresilError as err:
        if not err.reported_by_cli:
            raise
        print(f"megaresil: error: {err}", file=sys.stderr)
        return err.exit_status
