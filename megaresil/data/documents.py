"""The documents `megaresil eval --data` scores, as token ids: a Megatron
indexed dataset (PREFIX.bin/.idx) read as it is, or a JSON Lines file of
{"text": ...} records tokenized as `data prepare` tokenizes (the run's
tokenizer, each document followed by its eod). Every refusal is a
ConfigError on --data naming the fix, raised before the model loads."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from megaresil.config import ConfigError, DataConfig
from megaresil.data import indexed
from megaresil.data.build import blend_of, recipe_tokenizer
from megaresil.data.prepare import encode_document, prepare_dataset
from megaresil.data.provenance import (
    bpe_file,
    read_record,
    record_path,
    tokenizer_identity,
    tokenizer_spec,
)

JSONL_SUFFIXES = (".jsonl", ".json")


def load_documents(source: str, data_cfg: DataConfig, model_vocab_size: int) -> list[np.ndarray]:
    """`source`'s documents, in order. A path ending .jsonl/.json is JSON
    Lines; anything else an indexed prefix (PREFIX, PREFIX.bin or PREFIX.idx)."""
    if source.endswith(JSONL_SUFFIXES):
        return _jsonl_documents(Path(source), data_cfg, model_vocab_size)
    prefix = source[:-4] if source.endswith((".bin", ".idx")) else source
    return _indexed_documents(prefix, data_cfg, model_vocab_size)


def _jsonl_documents(path: Path, data_cfg: DataConfig, model_vocab_size: int) -> list[np.ndarray]:
    if not path.is_file():
        raise ConfigError("--data", f"{path}: no such file.",
                          "name a JSON Lines file of {\"text\": ...} records, or an indexed "
                          "prefix (PREFIX.bin/.idx, as `megaresil data prepare` writes).")
    try:
        tokenizer = recipe_tokenizer(data_cfg, model_vocab_size)
    except ValueError as err:  # synthetic data: no tokenizer to read text with
        raise ConfigError("--data", f"{err} The run has no tokenizer for {path}'s text.",
                          "evaluate it on an indexed prefix of token ids instead.") from None
    return [encode_document(tokenizer, text) for text in _texts(path)]


def _texts(path: Path) -> list[str]:
    """Each non-blank line's "text", in order."""
    texts = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ConfigError("--data", f"{path} line {number} is not JSON ({err}).",
                                  "write one JSON object a line.") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError("--data", f"{path} line {number} has no \"text\" string.",
                                  "give every line a \"text\" field holding its document.")
            texts.append(record["text"])
    return texts


def _indexed_documents(prefix: str, data_cfg: DataConfig,
                       model_vocab_size: int) -> list[np.ndarray]:
    if not indexed.exists(prefix):
        missing = [p for p in (indexed.bin_path(prefix), indexed.idx_path(prefix))
                   if not Path(p).is_file()]
        raise ConfigError("--data", f"{' and '.join(missing)}: no such file.",
                          "name a prefix whose .bin and .idx are both there (as `megaresil "
                          "data prepare --output PREFIX` writes), or a .jsonl file.")
    _check_tokenizer(prefix, data_cfg, model_vocab_size)
    dataset = indexed.IndexedDataset(prefix)
    documents = [np.asarray(dataset[i], dtype=np.int64) for i in range(len(dataset))]
    largest = max((int(d.max()) for d in documents if len(d)), default=-1)
    if largest >= model_vocab_size:
        raise ConfigError("--data", f"{prefix} holds token id {largest}; the model has "
                          f"{model_vocab_size} ids: it was tokenized for another model.",
                          "prepare the data with the run's tokenizer (`megaresil data prepare "
                          "--tokenizer ...`).")
    return documents


def _check_tokenizer(prefix: str, data_cfg: DataConfig, model_vocab_size: int) -> None:
    """Refuse data whose record (PREFIX.prepared.json) names a tokenizer
    other than the run's; data without a record is taken as the run's, as
    training takes it."""
    prepared = read_record(prefix)
    if prepared is None or data_cfg.source == "synthetic":
        return
    identity, name = run_tokenizer(data_cfg, model_vocab_size)
    if prepared.identity != identity:
        raise ConfigError("--data", f"{prefix} was prepared with {prepared.tokenizer} (so says "
                          f"{record_path(prefix)}), not the run's tokenizer ({name}): its ids "
                          "would be read as another tokenizer's.", "prepare it again with "
                          f"`megaresil data prepare --tokenizer {name}`, or pass the text as .jsonl.")


def run_tokenizer(data_cfg: DataConfig, model_vocab_size: int) -> tuple[str, str]:
    """The run's tokenizer as provenance.tokenizer_identity tells tokenizers
    apart (a built-in's name, else the digest of its tokenizer.json), and
    how `data prepare --tokenizer` names it ('bpe': the tokenizer.json
    trained for the run's corpus, or its first prefix's)."""
    spec = tokenizer_spec(data_cfg)
    if data_cfg.source == "indexed":
        prefix = blend_of(data_cfg)[0][1]
        return tokenizer_identity(spec, prefix), str(bpe_file(prefix)) if spec == "bpe" else spec
    if spec != "bpe":
        return tokenizer_identity(spec, ""), spec
    trained = prepare_dataset(data_cfg, vocab_size_limit=model_vocab_size).tokenizer_path
    assert trained is not None  # a bpe corpus records the tokenizer it trained
    return "sha256:" + hashlib.sha256(Path(trained).read_bytes()).hexdigest(), trained
