"""Corpora, tokenizers, Megatron indexed datasets and resumable batching."""
from __future__ import annotations

from megaresil.config import ConfigError, DataConfig
from megaresil.data.dataset import GPTDataset, SyntheticDataset
from megaresil.data.indexed import IndexedDataset, IndexedDatasetWriter
from megaresil.data.prepare import PreparedData, prepare_dataset, prepare_main
from megaresil.data.sampler import collate, micro_batches
from megaresil.data.tokenizer import build_tokenizer

__all__ = ["GPTDataset", "IndexedDataset", "IndexedDatasetWriter", "PreparedData",
           "SyntheticDataset", "build_datasets", "build_tokenizer", "collate", "micro_batches",
           "prepare_dataset", "prepare_main"]

Dataset = GPTDataset | SyntheticDataset


def build_datasets(data_cfg: DataConfig, model_vocab_size: int,
                   seed: int) -> tuple[Dataset, Dataset, PreparedData | None]:
    """(train, valid, info) for the recipe's data section; info is None for
    synthetic data. Both datasets are indexed by global sample index."""
    if data_cfg.source == "synthetic":
        # Same generated language, other samples: the valid seed differs.
        return (SyntheticDataset(model_vocab_size, data_cfg.seq_len, seed),
                SyntheticDataset(model_vocab_size, data_cfg.seq_len, seed + 1), None)
    info = prepare_dataset(data_cfg, vocab_size_limit=model_vocab_size)
    if info.vocab_size > model_vocab_size:
        origin = ("data.path" if data_cfg.source == "indexed"
                  else f"the {data_cfg.tokenizer} tokenizer")
        raise ConfigError("model.vocab_size", f"is {model_vocab_size}, but {origin} uses "
                          f"{info.vocab_size} token ids.",
                          f"set model.vocab_size={info.vocab_size} (or larger).")
    return (GPTDataset(IndexedDataset(info.train_prefix), data_cfg.seq_len, seed),
            GPTDataset(IndexedDataset(info.valid_prefix), data_cfg.seq_len, seed), info)
