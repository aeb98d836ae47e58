"""What several commands share: the recipe and its overrides as arguments,
and a checkpoint named by a run directory, root or `latest`."""
from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def add_recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe YAML or a packaged recipe's name, e.g. "
                        "gpt-tiny (`megaresil recipes` lists them)")
    # A default makes argparse count the overrides optional: without one,
    # `megaresil train` alone says "required: recipe, KEY=VALUE".
    parser.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                        help="recipe overrides; values are YAML (parallel.tp=2, "
                             "faults='[{kind: kill, rank: 1, step: 7}]')")


def checkpoint_argument(path: str) -> Path:
    """The checkpoint a run directory, checkpoint root or `latest` means,
    said on stderr (stdout stays the command's, e.g. --json)."""
    from pathlib import Path

    from megaresil.checkpoint.location import resolve_checkpoint

    resolved, note = resolve_checkpoint(Path(path))
    if note:
        print(note, file=sys.stderr)
    return resolved


