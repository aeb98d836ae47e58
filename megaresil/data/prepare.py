"""Turn a corpus into Megatron indexed datasets (train + valid) and a tokenizer.

`prepare_dataset` caches the result under `data.cache_dir`, keyed by what
determines it, and is safe to call from many processes at once: one builds
(under a file lock, into a temporary directory renamed into place), the
others wait and reuse. Each document is tokenized and followed by eod, as
Megatron's preprocess_data.py --append-eod does.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from megaresil.config import ConfigError, DataConfig
from megaresil.data.corpus import corpus_documents, corpus_fingerprint
from megaresil.data.indexed import IndexedDataset, IndexedDatasetWriter, dtype_for_vocab, exists
from megaresil.data.tokenizer import Tokenizer, build_tokenizer

# Bump when corpus cleaning or the file layout changes, so old caches are not reused.
CACHE_FORMAT = 1
_META = "meta.json"


@dataclass(frozen=True)
class PreparedData:
    train_prefix: str
    valid_prefix: str
    tokenizer_path: str | None  # trained bpe tokenizer json; None for gpt2/byte
    vocab_size: int  # every token id in the data is below this
    eod_id: int | None  # None for 'indexed' data, whose tokenizer is unknown
    train_tokens: int
    valid_tokens: int


@dataclass(frozen=True)
class _Counts:
    train_documents: int
    valid_documents: int
    train_tokens: int
    valid_tokens: int
    vocab_size: int
    eod_id: int


def prepare_dataset(data_cfg: DataConfig, vocab_size_limit: int | None = None) -> PreparedData:
    """Indexed train/valid datasets for `data_cfg`, built once and cached.

    For the 'bpe' tokenizer, `vocab_size_limit` (model.vocab_size) is the
    vocabulary it is trained to.
    """
    if data_cfg.source == "synthetic":
        raise ValueError("data.source: 'synthetic' data is generated, not prepared.")
    if data_cfg.source == "indexed":
        return existing_indexed(data_cfg.path)
    _check_valid_fraction(data_cfg.valid_fraction)
    bpe_vocab = _bpe_vocab_size(data_cfg.tokenizer, vocab_size_limit)
    cache_dir = Path(data_cfg.cache_dir).resolve()
    target = cache_dir / _cache_name(data_cfg, bpe_vocab)
    if not (target / _META).is_file():
        with _exclusive_lock(cache_dir / f"{target.name}.lock"):
            if not (target / _META).is_file():  # another process may have built it meanwhile
                _build_cache_entry(target, data_cfg, bpe_vocab)
    return _read_cache_entry(target)


def _check_valid_fraction(valid_fraction: float) -> None:
    if not 0.0 <= valid_fraction < 1.0:
        raise ConfigError("data.valid_fraction", f"must lie in [0, 1), got {valid_fraction}.",
                          "give a small fraction such as 0.02.")


def _bpe_vocab_size(tokenizer: str, vocab_size_limit: int | None) -> int | None:
    if tokenizer != "bpe":
        return None
    if vocab_size_limit is None:
        raise ConfigError("model.vocab_size", "the 'bpe' tokenizer is trained to the model's "
                          "vocabulary size, but none was given.", "pass model.vocab_size.")
    return vocab_size_limit


def _cache_name(data_cfg: DataConfig, bpe_vocab: int | None) -> str:
    key = json.dumps({"format": CACHE_FORMAT, "corpus": corpus_fingerprint(data_cfg.source),
                      "tokenizer": data_cfg.tokenizer, "vocab_size": bpe_vocab,
                      "valid_fraction": data_cfg.valid_fraction}, sort_keys=True)
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(data_cfg.source).stem)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{label}-{data_cfg.tokenizer}{bpe_vocab or ''}-{digest}"


@contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_cache_entry(target: Path, data_cfg: DataConfig, bpe_vocab: int | None) -> None:
    # Holding the lock, any leftover temporary directory is a killed builder's.
    for stale in target.parent.glob(f".{target.name}.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    temp = target.parent / f".{target.name}.tmp{os.getpid()}"
    temp.mkdir(parents=True)
    try:
        counts = _prepare_files(corpus_documents(data_cfg.source), data_cfg.tokenizer, bpe_vocab,
                                data_cfg.valid_fraction, temp / "train", temp / "valid",
                                temp / "tokenizer.json" if bpe_vocab else None)
        (temp / _META).write_text(json.dumps(asdict(counts), indent=1))
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    os.rename(temp, target)


def _read_cache_entry(target: Path) -> PreparedData:
    meta = json.loads((target / _META).read_text())
    tokenizer = target / "tokenizer.json"
    return PreparedData(train_prefix=str(target / "train"), valid_prefix=str(target / "valid"),
                        tokenizer_path=str(tokenizer) if tokenizer.is_file() else None,
                        vocab_size=meta["vocab_size"], eod_id=meta["eod_id"],
                        train_tokens=meta["train_tokens"], valid_tokens=meta["valid_tokens"])


def existing_indexed(prefix: str | None) -> PreparedData:
    """An already prepared dataset: PREFIX, validated on PREFIX_valid when present
    (else on PREFIX itself). Its vocabulary size is the largest token id + 1."""
    if not prefix or not exists(prefix):
        raise ConfigError("data.path", f"no indexed dataset {prefix}.bin/.idx.",
                          "give the prefix of a prepared dataset "
                          "(create one with `megaresil data prepare`).")
    valid_prefix = f"{prefix}_valid" if exists(f"{prefix}_valid") else prefix
    train, valid = IndexedDataset(prefix), IndexedDataset(valid_prefix)
    tokenizer = Path(f"{prefix}_tokenizer.json")
    return PreparedData(train_prefix=prefix, valid_prefix=valid_prefix,
                        tokenizer_path=str(tokenizer) if tokenizer.is_file() else None,
                        vocab_size=max(_max_token(train), _max_token(valid)) + 1, eod_id=None,
                        train_tokens=train.num_tokens, valid_tokens=valid.num_tokens)


def _max_token(indexed: IndexedDataset) -> int:
    tokens = indexed.tokens()
    return int(np.max(tokens)) if len(tokens) else -1


def split_train_valid(documents: list[str], valid_fraction: float) -> tuple[list[str], list[str]]:
    """The last round(fraction * n) documents (at least one) are held out; a
    single document is cut at a line boundary instead."""
    if len(documents) == 1:
        documents = _cut_document(documents[0], valid_fraction)
    n_valid = min(len(documents) - 1, max(1, round(len(documents) * valid_fraction)))
    return documents[:-n_valid], documents[-n_valid:]


def _cut_document(text: str, valid_fraction: float) -> list[str]:
    if len(text) < 2:
        raise ConfigError("data.source", "the corpus is a single document too short to split "
                          "into train and valid.", "use a larger corpus.")
    cut = int(len(text) * (1.0 - valid_fraction))
    line_end = text.rfind("\n", 0, cut)
    cut = min(max(line_end + 1 if line_end > 0 else cut, 1), len(text) - 1)
    return [text[:cut], text[cut:]]


def _prepare_files(documents: list[str], tokenizer_kind: str, vocab_size: int | None,
                  valid_fraction: float, train_prefix: Path | str, valid_prefix: Path | str,
                  tokenizer_path: Path | str | None) -> _Counts:
    """Split, train the tokenizer on the train split ('bpe'), write both datasets."""
    train_docs, valid_docs = split_train_valid(documents, valid_fraction)
    tokenizer = build_tokenizer(tokenizer_kind, corpus_text=train_docs, vocab_size=vocab_size,
                                cache_path=tokenizer_path)
    return _Counts(train_documents=len(train_docs), valid_documents=len(valid_docs),
                   train_tokens=_write_indexed(train_prefix, train_docs, tokenizer),
                   valid_tokens=_write_indexed(valid_prefix, valid_docs, tokenizer),
                   vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id)


def _write_indexed(prefix: Path | str, documents: list[str], tokenizer: Tokenizer) -> int:
    tokens = 0
    with IndexedDatasetWriter(prefix, dtype_for_vocab(tokenizer.vocab_size)) as writer:
        for document in documents:
            ids = tokenizer.encode(document) + [tokenizer.eod_id]
            writer.add_document(ids)
            tokens += len(ids)
        writer.finalize()
    return tokens


def prepare_main(input: str, output_prefix: str, tokenizer: str = "bpe",
                 vocab_size: int | None = 4096, valid_fraction: float = 0.02) -> tuple[str, str]:
    """`megaresil data prepare`: write OUTPUT.bin/.idx, OUTPUT_valid.bin/.idx and,
    for 'bpe', OUTPUT_tokenizer.json (the layout `data.source=indexed` reads)."""
    _check_valid_fraction(valid_fraction)
    valid_prefix = f"{output_prefix}_valid"
    tokenizer_path = f"{output_prefix}_tokenizer.json" if tokenizer == "bpe" else None
    if tokenizer_path:
        Path(tokenizer_path).unlink(missing_ok=True)  # retrain, never reuse a stale one
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    counts = _prepare_files(corpus_documents(input), tokenizer, vocab_size, valid_fraction,
                           output_prefix, valid_prefix, tokenizer_path)
    files = [f"{output_prefix}.{{bin,idx}}", f"{valid_prefix}.{{bin,idx}}"] + \
        ([tokenizer_path] if tokenizer_path else [])
    print(f"prepared {counts.train_documents + counts.valid_documents} documents "
          f"({counts.train_documents} train, {counts.valid_documents} valid), "
          f"{counts.train_tokens + counts.valid_tokens} tokens "
          f"({counts.train_tokens} train, {counts.valid_tokens} valid), vocab "
          f"{counts.vocab_size} -> {', '.join(files)}")
    return output_prefix, valid_prefix
