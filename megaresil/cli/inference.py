"""`megaresil eval` and `megaresil generate`: a checkpoint's model put to use."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from megaresil.cli.common import checkpoint_argument
from megaresil.config import ConfigError


def cmd_eval(args: argparse.Namespace) -> int:
    import json

    from megaresil.inference import evaluate

    if args.data is not None:
        return eval_documents(args)
    if args.per_document is not None:
        raise ConfigError("--per-document", "needs --data: the documents it lists.",
                          "pass --data PREFIX_OR_JSONL too.")
    split = args.split or "valid"
    result = evaluate(checkpoint_argument(args.path), args.batches, split, tp=args.tp)
    print(json.dumps(result) if args.json else
          f"step {result['step']}: {result['split']} loss {result['loss']:.4f}, perplexity "
          f"{result['perplexity']:.2f} ({result['batches']} batches, {result['checkpoint']})")
    return 0


def eval_documents(args: argparse.Namespace) -> int:
    """`eval --data`: the summary on stdout, every document's figures in --per-document."""
    import json

    from megaresil.inference_documents import evaluate_documents
    from megaresil.safe_files import write_atomic

    for flag, value in (("--batches", args.batches), ("--split", args.split)):
        if value is not None:
            raise ConfigError(flag, "does not apply with --data: every document of it is "
                              "scored.", f"drop {flag}.")
    out = None if args.per_document is None else Path(args.per_document)
    if out is not None and not out.parent.is_dir():
        raise ConfigError("--per-document", f"{out.parent}: no such directory.",
                          "name a file in an existing directory.")
    result = evaluate_documents(checkpoint_argument(args.path), args.data, tp=args.tp)
    if out is not None:
        write_atomic(out, json.dumps(result, indent=1) + "\n")
    summary = {key: value for key, value in result.items() if key != "per_document"}
    loss = "n/a" if result["loss"] is None else (f"{result['loss']:.4f}, perplexity "
                                                 f"{result['perplexity']:.2f}")
    print(json.dumps(summary) if args.json else
          f"step {result['step']}: {args.data} loss {loss} ({result['documents']} documents, "
          f"{result['tokens']} tokens in windows of {result['window']}, {result['checkpoint']})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import json

    from megaresil.generation import Sampling
    from megaresil.inference import generate

    prompts = list(args.prompt or []) + prompts_in(args.prompts_file)
    if not prompts:
        raise ConfigError("--prompt", "no prompt given.",
                          "pass --prompt TEXT (repeatable) or --prompts-file FILE.")
    results = generate(checkpoint_argument(args.path), prompts,
                       max_new_tokens=args.max_new_tokens,
                       sampling=Sampling(args.temperature, args.top_k, args.seed),
                       tp=args.tp, tokenizer=args.tokenizer)
    for number, result in enumerate(results, 1):
        if result["stopped_at_context"]:
            print(f"megaresil: prompt {number} reached the model's context (model.max_seq_len) "
                  f"after {len(result['token_ids'])} new tokens; generation stops there. Fix: a "
                  "shorter prompt, or fewer --max-new-tokens.", file=sys.stderr)
        print(json.dumps(result) if args.json else result["prompt"] + result["completion"])
    return 0


def prompts_in(path: Optional[str]) -> list[str]:
    """A --prompts-file's prompts: one a line, blank lines skipped."""
    if path is None:
        return []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ConfigError("--prompts-file", f"{path}: {err.strerror}.",
                          "name a text file with one prompt a line.") from None
    return [line for line in lines if line.strip()]


TP_HELP = ("tensor-parallel processes holding the model (default 1: one process); one per GPU "
           "for a model too big for one")


def add_checkpoint_use_parsers(sub) -> None:
    evaluate = sub.add_parser("eval", help="loss and perplexity of a checkpoint on the held-out "
                              "split (the run's own eval batches), in one process (or --tp N)")
    evaluate.add_argument("path", metavar="CKPT|RUN_DIR", help="a checkpoint, or a run "
                          "directory (its newest checkpoint)")
    evaluate.add_argument("--batches", type=int, help="global batches (default: the run's "
                          "train.eval_batches)")
    evaluate.add_argument("--split", choices=("valid", "test"),
                          help="valid (the default: the run's own eval batches) or test (held "
                          "out from both training and eval; how it is carved: docs/data.md, Splits)")
    evaluate.add_argument("--data", metavar="PREFIX_OR_JSONL", help="score these documents "
                          "instead: an indexed prefix (PREFIX.bin/.idx) or a .jsonl file of "
                          "{\"text\": ...} records (the run's tokenizer reads them); each "
                          "document alone, in windows of data.seq_len (docs/inference.md)")
    evaluate.add_argument("--per-document", metavar="OUT.json", help="with --data: write "
                          "every document's index, tokens, loss and perplexity there, as JSON")
    evaluate.add_argument("--json", action="store_true")
    evaluate.add_argument("--tp", type=int, default=1, help=TP_HELP)
    evaluate.set_defaults(func=cmd_eval)
    gen = sub.add_parser("generate", help="continue prompts with a checkpoint's model, as one "
                         "batch, in one process (or --tp N)")
    gen.add_argument("path", metavar="CKPT|RUN_DIR", help="a checkpoint, or a run directory "
                     "(its newest checkpoint)")
    gen.add_argument("--prompt", action="append", help="a prompt; repeat it for several, "
                     "generated as one batch (each continued as it would be alone)")
    gen.add_argument("--prompts-file", metavar="FILE", help="more prompts, one a line (blank "
                     "lines skipped), after any --prompt")
    gen.add_argument("--max-new-tokens", type=int, default=50)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    gen.add_argument("--top-k", type=int, help="sample among the k likeliest tokens only")
    gen.add_argument("--seed", type=int, default=0, help="seed of the sampling")
    gen.add_argument("--tokenizer", metavar="SPEC", help="the tokenizer the model trained "
                     "with, where the run's data.tokenizer does not name it (a tokenizer.json, "
                     "a model directory, gpt2, bpe or byte); default: the run's data.tokenizer")
    gen.add_argument("--json", action="store_true", help="one JSON line a prompt, with its "
                     "token ids")
    gen.add_argument("--tp", type=int, default=1, help=TP_HELP)
    gen.set_defaults(func=cmd_generate)


