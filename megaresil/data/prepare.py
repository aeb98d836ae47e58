"""Turn corpora into Megatron indexed datasets.

`prepare_main` (`megaresil data prepare`) streams text or JSON Lines files
through tokenizer worker processes into one PREFIX.bin/.idx, in bounded
memory; training splits it into train/valid (data.split). `prepare_dataset`
turns a recipe's named corpus (shakespeare, kjv, a file) into train and valid
datasets cached under `data.cache_dir`, keyed by what determines them, and is
safe to call from many processes at once: one builds (under a file lock, into
a temporary directory renamed into place), the others wait and reuse. Each
document is tokenized and followed by eod, as Megatron's preprocess_data.py
--append-eod does.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np

from megaresil.config import ConfigError, DataConfig
from megaresil.data.corpus import (
    MAX_RECORD_BYTES,
    BytesRead,
    corpus_documents,
    corpus_fingerprint,
    input_bytes,
    iter_documents,
)
from megaresil.data.filelock import exclusive_lock
from megaresil.data.indexed import IndexedDatasetWriter, dtype_for_vocab
from megaresil.data.provenance import bpe_file, record, record_path, tokenizer_spec
from megaresil.data.tokenizer import BUILTIN, Tokenizer, build_tokenizer, hf_tokenizer_file
from megaresil.terminal import SizedProgress

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
        raise ValueError("data.source: 'indexed' data is read as it is, not prepared.")
    _check_valid_fraction(data_cfg.valid_fraction)
    tokenizer = tokenizer_spec(data_cfg)
    data_cfg = dataclasses.replace(data_cfg, tokenizer=tokenizer)
    bpe_vocab = _bpe_vocab_size(tokenizer, vocab_size_limit)
    cache_dir = Path(data_cfg.cache_dir).resolve()
    target = cache_dir / _cache_name(data_cfg, bpe_vocab)
    if not (target / _META).is_file():
        with exclusive_lock(cache_dir / f"{target.name}.lock", "data.cache_dir"):
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
    tokenizer = data_cfg.tokenizer
    assert tokenizer is not None  # prepare resolved it
    if tokenizer not in BUILTIN:  # a Hugging Face tokenizer: its file's identity
        file = hf_tokenizer_file(Path(tokenizer))
        tokenizer = f"{file.resolve()}:{file.stat().st_size}:{file.stat().st_mtime_ns}"
    key = json.dumps({"format": CACHE_FORMAT, "corpus": corpus_fingerprint(data_cfg.source),
                      "tokenizer": tokenizer, "vocab_size": bpe_vocab,
                      "valid_fraction": data_cfg.valid_fraction}, sort_keys=True)
    label = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(data_cfg.source).stem)
    kind = data_cfg.tokenizer if data_cfg.tokenizer in BUILTIN else "hf"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return f"{label}-{kind}{bpe_vocab or ''}-{digest}"


def _build_cache_entry(target: Path, data_cfg: DataConfig, bpe_vocab: int | None) -> None:
    # Holding the lock, any leftover temporary directory is a killed builder's.
    for stale in target.parent.glob(f".{target.name}.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
    temp = target.parent / f".{target.name}.tmp{os.getpid()}"
    temp.mkdir(parents=True)
    assert data_cfg.tokenizer is not None  # prepare resolved it
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
    encoded = (encode_document(tokenizer, document) for document in documents)
    return write_indexed(prefix, encoded, dtype_for_vocab(tokenizer.vocab_size)).tokens


def encode_document(tokenizer: Tokenizer, document: str) -> np.ndarray:
    return np.array(tokenizer.encode(document) + [tokenizer.eod_id], dtype=np.int64)


@dataclass(frozen=True)
class Written:
    documents: int
    tokens: int


def write_indexed(prefix: Path | str, encoded: Iterable[np.ndarray], dtype: type) -> Written:
    """Write each array as one document of PREFIX.bin/.idx (atomically)."""
    documents = tokens = 0
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for ids in encoded:
            writer.add_document(ids)
            documents, tokens = documents + 1, tokens + len(ids)
        writer.finalize()
    return Written(documents, tokens)


# --- `megaresil data prepare` ---------------------------------------------------------------

_BATCH_CHARACTERS = 1 << 20  # text per task sent to a worker
_TASKS_PER_WORKER = 4  # tasks in flight per worker: the bound on memory held


@dataclass(frozen=True)
class Summary:
    prefix: str
    tokenizer_path: str | None
    documents: int
    tokens: int
    skipped_empty: int
    seconds: float

    def line(self) -> str:
        rate = self.tokens / max(self.seconds, 1e-9)
        files = f"{self.prefix}.{{bin,idx,prepared.json}}" + (f", {self.tokenizer_path}"
                                                              if self.tokenizer_path else "")
        skipped = f" ({self.skipped_empty} empty skipped)" if self.skipped_empty else ""
        return (f"prepared {self.documents:,} documents{skipped}, {self.tokens:,} tokens in "
                f"{self.seconds:.1f} s ({rate:,.0f} tokens/s) -> {files}")


def prepare_main(inputs: Sequence[str], output_prefix: str, tokenizer: str = "bpe", *,
                 json_key: str | None = None, workers: int | None = None,
                 vocab_size: int = 4096, max_record_bytes: int | None = None) -> Summary:
    """Tokenize every document of `inputs` (corpus names, text or JSON Lines
    files) in order into OUTPUT.bin/.idx, each followed by eod. 'bpe' is first
    trained on the inputs and saved as OUTPUT_tokenizer.json (the file that
    data.source=indexed with data.tokenizer=bpe reads). A JSON Lines record
    over `max_record_bytes` (default corpus.MAX_RECORD_BYTES) is refused.
    Which tokenizer made the data is recorded beside it (data/provenance.py);
    how far each pass over the inputs is goes to stderr (SizedProgress)."""
    start = time.perf_counter()
    max_record_bytes = max_record_bytes or MAX_RECORD_BYTES
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    record_path(output_prefix).unlink(missing_ok=True)  # it names the old data's tokenizer
    tokenizer_path = str(bpe_file(output_prefix)) if tokenizer == "bpe" else None
    total = input_bytes(inputs)
    if tokenizer_path:
        Path(tokenizer_path).unlink(missing_ok=True)  # retrain, never reuse a stale one
        read = BytesRead()
        with SizedProgress("data prepare: training the BPE tokenizer", total) as progress:
            build_tokenizer("bpe", vocab_size=vocab_size, cache_path=tokenizer_path,
                            corpus_text=_reported(_read_upto(_documents(
                                inputs, json_key, max_record_bytes, read), read), progress))
    spec = (tokenizer, tokenizer_path)
    vocab = build_tokenizer(tokenizer, cache_path=tokenizer_path).vocab_size
    skipped: collections.Counter[str] = collections.Counter()
    read = BytesRead()
    documents = _non_empty(_documents(inputs, json_key, max_record_bytes, read), skipped)
    workers = workers or min(8, os.cpu_count() or 1)
    with SizedProgress("data prepare", total) as progress:
        written = write_indexed(output_prefix, _reported(
            encode_in_workers(documents, spec, workers, read), progress), dtype_for_vocab(vocab))
    record(output_prefix, tokenizer)
    summary = Summary(output_prefix, tokenizer_path, written.documents, written.tokens,
                      skipped["empty"], time.perf_counter() - start)
    print(summary.line())
    return summary


def _documents(inputs: Sequence[str], json_key: str | None, max_record_bytes: int,
               read: BytesRead) -> Iterator[str]:
    return itertools.chain.from_iterable(iter_documents(source, json_key, max_record_bytes, read)
                                         for source in inputs)


def _read_upto(documents: Iterable[str], read: BytesRead) -> Iterator[tuple[str, int]]:
    """Each document with the input bytes read once it was."""
    return ((document, read.count) for document in documents)


def _reported(items: Iterable[tuple[Any, int]], progress: SizedProgress) -> Iterator[Any]:
    """The items (documents, or their token ids) of (item, input bytes read
    once it was) pairs, reporting how far the input is and how many
    documents (and tokens) went by."""
    documents = tokens = 0
    for item, read_upto in items:
        documents += 1
        figures = {"documents": documents}
        if isinstance(item, np.ndarray):
            tokens += len(item)
            figures["tokens"] = tokens
        progress.update(read_upto, **figures)
        yield item


def _non_empty(documents: Iterable[str], skipped: collections.Counter) -> Iterator[str]:
    """Megatron drops documents that tokenize to nothing; so do we, counting them."""
    for document in documents:
        if document:
            yield document
        else:
            skipped["empty"] += 1


def encode_in_workers(documents: Iterable[str], spec: tuple[str, str | None], workers: int,
                      read: BytesRead) -> Iterator[tuple[np.ndarray, int]]:
    """encode_document of each document, in order, over `workers` processes with
    a bounded number of batches in flight (Pool.imap would read the whole input
    ahead); each with the input bytes `read` counted once its batch was read
    (what is done once it is written: the reading runs ahead)."""
    if workers <= 1:
        tokenizer = build_tokenizer(spec[0], cache_path=spec[1])
        yield from ((encode_document(tokenizer, document), read_upto)
                    for document, read_upto in _read_upto(documents, read))
        return
    # A forked child cannot use the parent's tokenizer threads; saying so up
    # front silences the tokenizers library's warning about it.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with multiprocessing.get_context("fork").Pool(workers, _init_worker, (spec,)) as pool:
        pending: collections.deque = collections.deque()
        for batch in _batches(documents):
            pending.append((pool.apply_async(_encode_batch, (batch,)), read.count))
            if len(pending) >= workers * _TASKS_PER_WORKER:
                yield from _with_read(*pending.popleft())
        while pending:
            yield from _with_read(*pending.popleft())


def _with_read(task, read_upto: int) -> Iterator[tuple[np.ndarray, int]]:
    return ((ids, read_upto) for ids in task.get())


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    characters = 0
    for document in documents:
        batch.append(document)
        characters += len(document)
        if characters >= _BATCH_CHARACTERS:
            yield batch
            batch, characters = [], 0
    if batch:
        yield batch


_worker_tokenizer: Tokenizer | None = None  # one per worker process, set by _init_worker


def _init_worker(spec: tuple[str, str | None]) -> None:
    global _worker_tokenizer
    _worker_tokenizer = build_tokenizer(spec[0], cache_path=spec[1])


def _encode_batch(batch: list[str]) -> list[np.ndarray]:
    assert _worker_tokenizer is not None
    return [encode_document(_worker_tokenizer, document) for document in batch]
