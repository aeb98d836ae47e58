"""`megaresil recipes`, `config show|docs` and `data prepare`: recipes, the
config schema and datasets."""
from __future__ import annotations

import argparse
import sys
import textwrap

from megaresil.cli.common import add_recipe_args
from megaresil.config import field_docs, load_recipe, packaged_recipes, to_yaml


def cmd_config_show(args: argparse.Namespace) -> int:
    overrides = args.overrides
    if args.from_hf:  # what `train RECIPE --from-hf DIR` would run, without running it
        from pathlib import Path

        from megaresil.launch.from_hf import check_hf_init, resolve_from_hf

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
              f"data.source=indexed data.path={args.output} reads)")
    prepare_main(args.input, args.output, args.tokenizer or "bpe", json_key=args.json_key,
                 workers=args.workers, vocab_size=args.vocab_size,
                 max_record_bytes=args.max_record_bytes)
    return 0


def add_recipes_parser(sub) -> None:
    sub.add_parser("recipes", help="list the packaged recipes (train one by name: "
                   "megaresil train gpt-tiny)").set_defaults(func=cmd_recipes)


def add_config_parser(sub) -> None:
    config = sub.add_parser("config", help="inspect recipes and the config schema")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved recipe")
    add_recipe_args(show)
    show.add_argument("--from-hf", metavar="DIR", help="as `train RECIPE --from-hf DIR` would "
                      "resolve it (a dry run: nothing starts)")
    show.set_defaults(func=cmd_config_show, overrides_anywhere=True)
    config_sub.add_parser("docs", help="list every recipe key with its type, default and "
                          "meaning").set_defaults(func=cmd_config_docs)


def add_data_parser(sub) -> None:
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
