"""Corpora, tokenizers, Megatron indexed datasets, blends, cached shuffle
indices and resumable batching."""
from __future__ import annotations

from megaresil.data.blend import BlendedDataset
from megaresil.data.build import build_datasets, end_of_document_id, recipe_tokenizer
from megaresil.data.dataset import GPTDataset, SyntheticDataset
from megaresil.data.indexed import IndexedDataset, IndexedDatasetWriter
from megaresil.data.prepare import PreparedData, prepare_dataset, prepare_main
from megaresil.data.sampler import collate, micro_batches
from megaresil.data.tokenizer import build_tokenizer

__all__ = ["BlendedDataset", "GPTDataset", "IndexedDataset", "IndexedDatasetWriter",
           "PreparedData", "SyntheticDataset", "build_datasets", "build_tokenizer", "collate",
           "end_of_document_id", "micro_batches", "prepare_dataset", "prepare_main", "recipe_tokenizer"]
