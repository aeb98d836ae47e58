"""Fast tests of megaresil.data: indexed format, tokenizers, corpora, prepare
cache, datasets and the resumable sampler (blends, splits, the shuffle-index
cache and streaming prepare are in test_data_blend.py)."""
from __future__ import annotations

import multiprocessing
import pickle
import shutil
import struct
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from megaresil.config import ConfigError, DataConfig
from megaresil.data import (GPTDataset, IndexedDataset, IndexedDatasetWriter, SyntheticDataset,
                            build_datasets, build_tokenizer, collate, micro_batches,
                            prepare_dataset)
from megaresil.data.corpus import corpus_documents, kjv_books, markdown_to_text
from megaresil.data.indexed import dtype_for_vocab
from megaresil.data import prepare as prepare_module
from megaresil.data.prepare import split_train_valid


def write_indexed(prefix: Path, documents: list[list[int]], dtype: type) -> None:
    writer = IndexedDatasetWriter(prefix, dtype)
    for document in documents:
        writer.add_document(document)
    writer.finalize()


def text_corpus(tmp_path: Path, documents: int = 6) -> Path:
    body = "\n\n\n".join(f"Document {d}.\nTo be, or not to be: that is question {d}.\n"
                         * (3 + d) for d in range(documents))
    path = tmp_path / "corpus.txt"
    path.write_text(body, encoding="utf-8")
    return path


# --- indexed format -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65000), (np.int32, 2**31 - 1)])
def test_indexed_round_trip(tmp_path, dtype, high):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, high, size=n).tolist() for n in (5, 0, 17, 1)]
    write_indexed(tmp_path / "ds", documents, dtype)

    ds = IndexedDataset(tmp_path / "ds")
    assert ds.dtype is dtype and len(ds) == 4 and ds.num_documents == 4
    assert ds.num_tokens == 23
    for i, document in enumerate(documents):
        assert ds[i].tolist() == document
    assert ds.tokens().tolist() == sum(documents, [])
    blob = pickle.dumps(ds)  # by path, as DataLoader workers receive it
    assert len(blob) < 1000 and pickle.loads(blob)[2].tolist() == documents[2]


def test_idx_layout_is_megatrons(tmp_path):
    write_indexed(tmp_path / "ds", [[1, 2, 3], [4, 5]], np.uint16)
    idx = (tmp_path / "ds.idx").read_bytes()

    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = struct.unpack_from("<QBQQ", idx, 9)
    assert (version, code, sequences, documents) == (1, 8, 2, 3)
    assert struct.unpack_from("<2i", idx, 34) == (3, 2)  # tokens per sequence
    assert struct.unpack_from("<2q", idx, 42) == (0, 6)  # byte offsets into .bin
    assert struct.unpack_from("<3q", idx, 58) == (0, 1, 2)  # document indices
    assert len(idx) == 82
    assert (tmp_path / "ds.bin").read_bytes() == struct.pack("<5H", 1, 2, 3, 4, 5)


def test_reads_a_file_written_independently(tmp_path):
    # Two documents made of three sequences (as Megatron writes with sentence splitting).
    sequences = [[7, 8], [9], [10, 11, 12]]
    (tmp_path / "ext.bin").write_bytes(struct.pack("<6i", *sum(sequences, [])))
    (tmp_path / "ext.idx").write_bytes(
        b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 3, 3)
        + struct.pack("<3i", 2, 1, 3) + struct.pack("<3q", 0, 8, 12) + struct.pack("<3q", 0, 2, 3))

    ds = IndexedDataset(tmp_path / "ext")
    assert ds.dtype is np.int32 and len(ds) == 3 and ds.num_documents == 2
    assert [ds[i].tolist() for i in range(3)] == sequences


def test_writer_leaves_nothing_when_interrupted(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as writer:
            writer.add_document([1, 2])
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_ids_that_do_not_fit(tmp_path):
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as writer, pytest.raises(ValueError):
        writer.add_document([70000])


def test_dtype_follows_megatrons_rule():
    assert dtype_for_vocab(50257) is np.uint16 and dtype_for_vocab(65500) is np.int32


# --- datasets -------------------------------------------------------------------------------


def test_gpt_dataset_is_deterministic_and_wraps_epochs(tmp_path):
    write_indexed(tmp_path / "ds", [list(range(0, 50)), list(range(50, 101))], np.uint16)
    indexed = IndexedDataset(tmp_path / "ds")
    ds, again = GPTDataset(indexed, seq_len=10, seed=3), GPTDataset(indexed, seq_len=10, seed=3)
    n = ds.samples_per_epoch
    assert n == 10

    for i in range(3 * n):
        inputs, targets = ds[i]
        assert inputs.dtype == torch.int64 and inputs.shape == (10,)
        assert torch.equal(targets, inputs + 1)  # tokens are 0..100 in order
        assert torch.equal(inputs, again[i][0])
    for epoch in range(3):
        starts = sorted(int(ds[epoch * n + k][0][0]) for k in range(n))
        assert starts == list(range(0, 100, 10))  # each window exactly once per epoch
    orders = [[int(ds[e * n + k][0][0]) for k in range(n)] for e in range(2)]
    assert orders[0] != orders[1]
    other_seed = GPTDataset(indexed, seq_len=10, seed=4)
    assert [int(other_seed[k][0][0]) for k in range(n)] != orders[0]


def test_gpt_dataset_rejects_a_corpus_shorter_than_one_sample(tmp_path):
    write_indexed(tmp_path / "ds", [[1, 2, 3]], np.uint16)
    with pytest.raises(ValueError, match="data.seq_len"):
        GPTDataset(IndexedDataset(tmp_path / "ds"), seq_len=3, seed=0)


def test_synthetic_dataset_is_deterministic_and_learnable():
    ds = SyntheticDataset(vocab_size=50, seq_len=16, seed=1)
    assert torch.equal(ds[7][0], SyntheticDataset(50, 16, 1)[7][0])
    successor: dict[int, int] = {}
    for i in range(40):
        inputs, targets = ds[i]
        assert inputs.shape == targets.shape == (16,) and int(inputs.max()) < 50
        assert torch.equal(inputs[1:], targets[:-1])
        for a, b in zip(inputs.tolist(), targets.tolist()):
            assert successor.setdefault(a, b) == b  # one successor per token
    valid = SyntheticDataset(50, 16, seed=2)
    assert all(successor.get(a, b) == b for a, b in zip(valid[0][0].tolist(), valid[0][1].tolist()))


# --- sampler --------------------------------------------------------------------------------


@pytest.mark.parametrize("consumed", [0, 48, 1000])
def test_dp_ranks_partition_the_global_batch_in_order(consumed):
    global_batch = list(range(consumed, consumed + 16))
    assert sum(micro_batches(consumed, 16, 2, 0, 1), []) == global_batch
    for dp in (2, 4):
        per_rank = [micro_batches(consumed, 16, 2, rank, dp) for rank in range(dp)]
        assert all(len(mb) == 2 for rank in per_rank for mb in rank)
        assert sum(sum(per_rank, []), []) == global_batch


def test_micro_batches_validate_divisibility():
    with pytest.raises(ValueError, match="train.global_batch_size"):
        micro_batches(0, 10, 4, 0, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        micro_batches(0, 16, 4, 2, 2)


def test_collate_stacks_inputs_and_targets():
    inputs, targets = collate(SyntheticDataset(64, 8, 0), [3, 4, 5])
    assert inputs.shape == targets.shape == (3, 8) and inputs.dtype == torch.int64


# --- corpora --------------------------------------------------------------------------------


def test_text_file_documents_split_on_double_blank_lines(tmp_path):
    documents = corpus_documents(str(text_corpus(tmp_path, documents=3)))
    assert len(documents) == 3 and documents[2].startswith("Document 2.")


def test_single_document_is_cut_for_validation():
    train, valid = split_train_valid(["line\n" * 100], 0.1)
    assert len(train) == len(valid) == 1 and train[0] + valid[0] == "line\n" * 100
    assert valid[0] == "line\n" * 10


def test_shakespeare_markdown_is_stripped():
    text = markdown_to_text("# Hamlet\n\n**BERNARDO**  \nWho's there?\n\n_\\[Aside]_  \n")
    assert text == "Hamlet\n\nBERNARDO:\nWho's there?\n\n[Aside]\n"


def test_kjv_dump_is_grouped_by_book():
    dump = "Ge1:1 In the beginning.\nGe1:2 And the earth.\n1Sm1:1 Now there was.\n"
    assert kjv_books(dump) == ["In the beginning.\nAnd the earth.\n", "Now there was.\n"]


def test_bad_source_names_the_key_and_fix(tmp_path):
    with pytest.raises(ConfigError, match="data.source.*Fix"):
        corpus_documents(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="data.tokenizer"):
        build_tokenizer("sentencepiece")


# --- tokenizers -----------------------------------------------------------------------------


def test_bpe_round_trips_shakespeare_and_is_deterministic(tmp_path):
    plays = corpus_documents("shakespeare")[:3]
    first, _ = (build_tokenizer("bpe", corpus_text=plays, vocab_size=512,
                                cache_path=tmp_path / name) for name in ("a.json", "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert first.vocab_size == 512 and first.eod_id == 0

    sample = plays[0][:2000]
    ids = first.encode(sample)
    assert first.decode(ids) == sample and len(ids) < 0.7 * len(sample)
    cached = build_tokenizer("bpe", cache_path=tmp_path / "a.json")
    assert cached.encode(sample) == ids


def test_gpt2_tokenizer_matches_gpt2():
    tokenizer = build_tokenizer("gpt2")
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert (tokenizer.vocab_size, tokenizer.eod_id) == (50257, 50256)


def test_byte_tokenizer_round_trips():
    tokenizer = build_tokenizer("byte")
    assert tokenizer.decode(tokenizer.encode("héllo") + [tokenizer.eod_id]) == "héllo"


# --- prepare --------------------------------------------------------------------------------


def byte_config(tmp_path: Path) -> DataConfig:
    return DataConfig(source=str(text_corpus(tmp_path)), tokenizer="byte", seq_len=16,
                      valid_fraction=0.2, cache_dir=str(tmp_path / "cache"))


def test_prepare_is_cached(tmp_path, monkeypatch):
    cfg = byte_config(tmp_path)
    first = prepare_dataset(cfg)
    # Counted, not timed: a second prepare that encodes no document read the
    # cache (the whole of what an elapsed-time bound stood for), however
    # loaded the machine is.
    encoded = []
    encode = prepare_module.encode_document
    monkeypatch.setattr(prepare_module, "encode_document",
                        lambda *args: encoded.append(args) or encode(*args))
    second = prepare_dataset(cfg)
    assert encoded == [] and second == first
    prepare_dataset(replace(cfg, valid_fraction=0.4))  # the counter counts
    assert encoded

    train, valid = IndexedDataset(first.train_prefix), IndexedDataset(first.valid_prefix)
    documents = corpus_documents(cfg.source)
    assert (len(train), len(valid)) == (5, 1)
    assert bytes(valid[0][:-1].tolist()).decode() == documents[-1] and int(valid[0][-1]) == 256
    assert first.train_tokens + first.valid_tokens == train.num_tokens + valid.num_tokens


def test_prepare_cache_key_follows_the_options(tmp_path):
    cfg = byte_config(tmp_path)
    assert prepare_dataset(replace(cfg, valid_fraction=0.4)) != prepare_dataset(cfg)


def _prepare_in_child(cfg: DataConfig, results) -> None:
    results.put(prepare_dataset(cfg))


def test_prepare_is_safe_under_concurrent_processes(tmp_path):
    cfg = byte_config(tmp_path)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_prepare_in_child, args=(cfg, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    prepared = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    assert prepared[0] == prepared[1] == prepare_dataset(cfg)
    cache_entries = [p.name for p in Path(cfg.cache_dir).iterdir() if not p.name.endswith(".lock")]
    assert len(cache_entries) == 1 and not cache_entries[0].startswith(".")


def test_missing_indexed_path_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):
        build_datasets(DataConfig(source="indexed", path=str(tmp_path / "none")), 300, 0)


def test_build_datasets_checks_the_model_vocab_size(tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_size=257"):
        build_datasets(byte_config(tmp_path), model_vocab_size=200, seed=0)
    train, valid, info = build_datasets(replace(byte_config(tmp_path), source="synthetic"), 64, 0)
    assert info is None and not torch.equal(train[0][0], valid[0][0])


def test_prepare_clears_a_killed_builders_leftovers(tmp_path):
    cfg = byte_config(tmp_path)
    entry = Path(prepare_dataset(cfg).train_prefix).parent
    shutil.rmtree(entry)
    stale = entry.parent / f".{entry.name}.tmp99999"
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"half")
    assert IndexedDataset(prepare_dataset(cfg).train_prefix).num_tokens > 0
    assert not stale.exists()


def test_failed_prepare_leaves_no_cache_entry(tmp_path):
    cfg = replace(byte_config(tmp_path), tokenizer="bpe")
    with pytest.raises(ValueError, match="model.vocab_size"):
        prepare_dataset(cfg, vocab_size_limit=100)  # fails while building
    assert [p.suffix for p in Path(cfg.cache_dir).iterdir()] == [".lock"]
