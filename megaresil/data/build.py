"""The recipe's datasets: `build_datasets` turns `data.*` into train and valid
datasets indexed by global sample index, `build_test_dataset` gives the
held-out test split (`megaresil eval --split test`), `recipe_tokenizer`
gives the tokenizer the data was made with, and `end_of_document_id` the
token that ends each document (document masking).

How each source is split into train, valid and test (data.split,
PREFIX_valid/_test, data.valid_fraction; a prepared corpus's held-out
halves) and blended: docs/data.md, "Splits" and "How it works".
"""
from __future__ import annotations

import re

from megaresil.config import ConfigError, DataConfig
from megaresil.data.blend import BlendedDataset, parse_blend
from megaresil.data.dataset import GPTDataset, SyntheticDataset
from megaresil.data.indexed import IndexedDataset, exists
from megaresil.data.prepare import PreparedData, prepare_dataset
from megaresil.data.provenance import bpe_file, check_prepared_with, tokenizer_spec
from megaresil.data.tokenizer import Tokenizer, build_tokenizer

Dataset = GPTDataset | SyntheticDataset | BlendedDataset


def build_datasets(data_cfg: DataConfig, model_vocab_size: int, seed: int, *,
                   need_valid: bool = True) -> tuple[Dataset, Dataset | None, PreparedData | None]:
    """(train, valid, info); info describes a prepared corpus (None for synthetic
    and indexed data). valid is None only when `need_valid` is False and the
    split leaves no valid documents."""
    if data_cfg.source == "synthetic":
        # Same generated language, other samples: the valid seed differs.
        return (SyntheticDataset(model_vocab_size, data_cfg.seq_len, seed),
                SyntheticDataset(model_vocab_size, data_cfg.seq_len, seed + 1), None)
    if data_cfg.source == "indexed":
        _check_tokenizer(data_cfg, model_vocab_size)
        train, valid = _indexed_datasets(data_cfg, model_vocab_size, seed, need_valid)
        return train, valid, None
    info = _prepared(data_cfg, model_vocab_size)
    # Named after the recipe's corpus, not the cache entry it was prepared into.
    return (GPTDataset(IndexedDataset(info.train_prefix), data_cfg.seq_len, seed,
                       index_dir=data_cfg.index_cache,
                       name=f"the train part of {data_cfg.source}"),
            _held_out_half(data_cfg, info, seed, "valid"), info)


def build_test_dataset(data_cfg: DataConfig, model_vocab_size: int, seed: int) -> Dataset:
    """The test split (how it is carved: docs/data.md, "Splits");
    ConfigError naming the fix when the recipe's data has none."""
    if data_cfg.source == "synthetic":
        return SyntheticDataset(model_vocab_size, data_cfg.seq_len, seed + 2)
    if data_cfg.source == "indexed":
        _check_tokenizer(data_cfg, model_vocab_size)
        blend = blend_of(data_cfg)
        tests = [_indexed_test(data_cfg, prefix, model_vocab_size, seed) for _, prefix in blend]
        return tests[0] if len(tests) == 1 else BlendedDataset(tests, [w for w, _ in blend])
    test = _held_out_half(data_cfg, _prepared(data_cfg, model_vocab_size), seed, "test")
    if test is None:
        raise ConfigError("data.valid_fraction", f"the held-out part of {data_cfg.source} is too "
                          f"small to halve into valid and test samples of {data_cfg.seq_len} "
                          "tokens, so there is no test split.", "raise data.valid_fraction (or "
                          "lower data.seq_len); evaluate on --split valid meanwhile.")
    return test


def _prepared(data_cfg: DataConfig, model_vocab_size: int) -> PreparedData:
    info = prepare_dataset(data_cfg, vocab_size_limit=model_vocab_size)
    if info.vocab_size > model_vocab_size:
        raise _vocab_error(model_vocab_size, info.vocab_size,
                           f"the {tokenizer_spec(data_cfg)} tokenizer")
    return info


def _held_out_half(data_cfg: DataConfig, info: PreparedData, seed: int,
                   split: str) -> GPTDataset | None:
    """The valid or test half of a prepared corpus's held-out part; valid is
    the whole part (test None) when it is too small to halve."""
    indexed = IndexedDataset(info.valid_prefix)
    halves = _halves(indexed, data_cfg.seq_len)
    if halves is None and split == "test":
        return None
    tokens = None if halves is None else halves[0 if split == "valid" else 1]
    return GPTDataset(indexed, data_cfg.seq_len, seed, tokens=tokens,
                      index_dir=data_cfg.index_cache,
                      name=f"the {split} part of {data_cfg.source}")


def _halves(indexed: IndexedDataset,
            seq_len: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """[start, end) tokens of the first and second half of `indexed`: split
    between documents when it holds several, else inside its one document;
    None when a half would hold less than one sample (seq_len + 1 tokens)."""
    documents = indexed.num_documents
    if documents >= 2:
        middle = indexed.document_tokens(0, documents // 2)[1]
    else:
        middle = indexed.num_tokens // 2
    halves = (0, middle), (middle, indexed.num_tokens)
    if any(end - start < seq_len + 1 for start, end in halves):
        return None
    return halves


def blend_of(data_cfg: DataConfig) -> list[tuple[float, str]]:
    """(weight, prefix) of every indexed dataset in the recipe."""
    blend = parse_blend(data_cfg.paths) if data_cfg.paths else [(1.0, data_cfg.path or "")]
    key = "data.paths" if data_cfg.paths else "data.path"
    for _, prefix in blend:
        if exists(prefix):
            continue
        named = re.fullmatch(r"(.+)\.(bin|idx)", prefix)
        if named:  # data/corpus.bin: a file of the dataset, not its prefix
            raise ConfigError(key, f"{prefix} names a file of an indexed dataset; the dataset "
                              "is named by its prefix, the path without .bin or .idx.",
                              f"give {named.group(1)} instead of {prefix}.")
        raise ConfigError(key, f"no indexed dataset {prefix}.bin/.idx.",
                          "give the prefix of a prepared dataset "
                          "(create one with `megaresil data prepare`).")
    return blend


def _indexed_datasets(data_cfg: DataConfig, vocab_size: int, seed: int,
                      need_valid: bool) -> tuple[Dataset, Dataset | None]:
    blend = blend_of(data_cfg)
    parts = [_train_and_valid(data_cfg, prefix, vocab_size, seed, need_valid)
             for _, prefix in blend]
    trains, valids = zip(*parts)
    if len(blend) == 1:
        return trains[0], valids[0]
    weights = [weight for weight, _ in blend]
    # A valid part is missing only when none is needed (need_valid=False).
    valid = None if None in valids else BlendedDataset(valids, weights)
    return BlendedDataset(trains, weights), valid


def _train_and_valid(data_cfg: DataConfig, prefix: str, vocab_size: int, seed: int,
                     need_valid: bool) -> tuple[GPTDataset, GPTDataset | None]:
    def dataset(indexed: IndexedDataset, tokens=None, name=None) -> GPTDataset:
        return _indexed_dataset(data_cfg, indexed, vocab_size, seed, tokens, name)

    indexed = IndexedDataset(prefix)
    if data_cfg.split is None and exists(f"{prefix}_valid"):
        return dataset(indexed), dataset(IndexedDataset(f"{prefix}_valid"))
    shares = split_shares(data_cfg)
    bounds = split_documents(indexed.num_documents, shares)
    train = dataset(indexed, indexed.document_tokens(bounds[0], bounds[1]),
                    f"{prefix} (train documents {bounds[0]}..{bounds[1] - 1})")
    if bounds[2] == bounds[1]:
        if need_valid:
            raise ConfigError("data.split", f"leaves no valid documents of {prefix} "
                              f"({indexed.num_documents} documents, shares {shares}); eval "
                              "would have no data of its own.",
                              "raise the valid share of data.split (or data.valid_fraction), "
                              f"provide {prefix}_valid, or set train.eval_batches=0.")
        return train, None
    return train, dataset(indexed, indexed.document_tokens(bounds[1], bounds[2]),
                          f"{prefix} (valid documents {bounds[1]}..{bounds[2] - 1})")


def _indexed_dataset(data_cfg: DataConfig, indexed: IndexedDataset, vocab_size: int, seed: int,
                     tokens: tuple[int, int] | None, name: str | None) -> GPTDataset:
    return GPTDataset(indexed, data_cfg.seq_len, seed, tokens=tokens, name=name,
                      index_dir=data_cfg.index_cache, vocab_size=vocab_size)


def _indexed_test(data_cfg: DataConfig, prefix: str, vocab_size: int, seed: int) -> GPTDataset:
    """A prefix's test part: data.split's test share, else PREFIX_test."""
    def dataset(indexed: IndexedDataset, tokens=None, name=None) -> GPTDataset:
        return _indexed_dataset(data_cfg, indexed, vocab_size, seed, tokens, name)

    if data_cfg.split is None and exists(f"{prefix}_test"):
        return dataset(IndexedDataset(f"{prefix}_test"))
    indexed = IndexedDataset(prefix)
    bounds = split_documents(indexed.num_documents, split_shares(data_cfg))
    if bounds[3] == bounds[2]:
        why = ("data.split gives it no test share" if data_cfg.split is not None else
               f"there is no {prefix}_test and no data.split")
        raise ConfigError("data.split", f"{prefix} has no test documents ({why}).",
                          "give data.split a test share, e.g. '969,30,1' (Megatron's), or "
                          f"provide {prefix}_test; evaluate on --split valid meanwhile.")
    return dataset(indexed, indexed.document_tokens(bounds[2], bounds[3]),
                   f"{prefix} (test documents {bounds[2]}..{bounds[3] - 1})")


def split_shares(data_cfg: DataConfig) -> list[float]:
    """[train, valid, test] shares summing to 1, from data.split or data.valid_fraction."""
    if data_cfg.split is None:
        return [1.0 - data_cfg.valid_fraction, data_cfg.valid_fraction, 0.0]
    try:
        shares = [float(part) for part in str(data_cfg.split).replace("/", ",").split(",")]
    except ValueError:
        shares = []
    if not 1 <= len(shares) <= 3 or any(s < 0 for s in shares) or sum(shares) <= 0:
        raise ConfigError("data.split", f"{data_cfg.split!r} is not train,valid,test shares.",
                          "write it as Megatron's --split does, e.g. '969,30,1'.")
    shares += [0.0] * (3 - len(shares))
    return [s / sum(shares) for s in shares]


def split_documents(documents: int, shares: list[float]) -> list[int]:
    """Document boundaries [0, train_end, valid_end, documents], rounded as
    Megatron's get_split_indices does (so a split matches Megatron's)."""
    bounds = [0]
    for share in shares:
        bounds.append(bounds[-1] + int(round(share * float(documents))))
    excess = bounds[-1] - documents
    return [bounds[0]] + [bound - excess for bound in bounds[1:]]


def recipe_tokenizer(data_cfg: DataConfig, model_vocab_size: int) -> Tokenizer:
    """The tokenizer the recipe's data was made with (for export and generation)."""
    if data_cfg.source == "synthetic":
        raise ValueError("data.source: 'synthetic' data has no tokenizer.")
    spec = tokenizer_spec(data_cfg)
    if spec != "bpe":
        return build_tokenizer(spec)
    if data_cfg.source != "indexed":
        info = prepare_dataset(data_cfg, vocab_size_limit=model_vocab_size)
        return build_tokenizer("bpe", cache_path=info.tokenizer_path)
    path = bpe_file(blend_of(data_cfg)[0][1])
    if not path.is_file():
        raise ConfigError("data.tokenizer", f"'bpe' indexed data needs the trained tokenizer "
                          f"{path}, which is missing.",
                          "set data.tokenizer to the tokenizer the data was prepared with.")
    return build_tokenizer("bpe", cache_path=path)


# How many documents of each indexed dataset `end_of_document_id` reads the
# last token of: enough to tell data prepared without an eod after each
# document, few enough to read at every start.
EOD_CHECKED_DOCUMENTS = 64


def end_of_document_id(data_cfg: DataConfig, model_vocab_size: int) -> int:
    """The token that ends each document of the recipe's corpus or indexed
    data (its tokenizer's eod, which `data prepare` appends after every
    document), for document masking. ConfigError naming the fix when an
    indexed dataset's first documents do not all end with it: data prepared
    without Megatron's --append-eod has no boundary to find."""
    if data_cfg.source != "indexed":
        eod = _prepared(data_cfg, model_vocab_size).eod_id
        assert eod is not None  # a prepared corpus records its tokenizer's
        return eod
    eod = recipe_tokenizer(data_cfg, model_vocab_size).eod_id
    for _, prefix in blend_of(data_cfg):
        indexed = IndexedDataset(prefix)
        documents = (indexed[i] for i in range(min(len(indexed), EOD_CHECKED_DOCUMENTS)))
        if any(len(tokens) and int(tokens[-1]) != eod for tokens in documents):
            raise ConfigError("data.paths" if data_cfg.paths else "data.path",
                              f"the documents of {prefix} do not all end with the "
                              f"end-of-document token {eod} of its tokenizer "
                              f"({tokenizer_spec(data_cfg)}): document masking has no "
                              "boundaries to find.", "prepare the data with `megaresil data "
                              "prepare` (or Megatron's --append-eod), or turn document masking "
                              "off.")
    return eod


def _check_tokenizer(data_cfg: DataConfig, model_vocab_size: int) -> None:
    """At start, for indexed data: the tokenizer is there, is the one every
    prefix was prepared with (where recorded), and fits the model."""
    spec = tokenizer_spec(data_cfg)
    check_prepared_with(spec, [prefix for _, prefix in blend_of(data_cfg)])
    tokenizer = recipe_tokenizer(data_cfg, model_vocab_size)
    if tokenizer.vocab_size > model_vocab_size:
        raise _vocab_error(model_vocab_size, tokenizer.vocab_size, f"data.tokenizer ({spec})")


def _vocab_error(model_vocab_size: int, vocab_size: int, origin: str) -> ConfigError:
    return ConfigError("model.vocab_size", f"is {model_vocab_size}, but {origin} uses "
                       f"{vocab_size} token ids.", f"set model.vocab_size={vocab_size} (or larger).")
