"""Unit tests of the data path from files to samples: Hugging Face tokenizers,
streaming parallel prepare, blends, train/valid splits and the shuffle-index
cache (start-up reads an index built once, never the whole corpus)."""
from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from megaresil.config import ConfigError, DataConfig, load_recipe
from megaresil.data import (BlendedDataset, GPTDataset, IndexedDataset, IndexedDatasetWriter,
                            build_datasets, build_tokenizer, prepare_main, recipe_tokenizer)
from megaresil.data.blend import PERIOD, counts_per_period, parse_blend
from megaresil.data.build import split_documents
from megaresil.data.index_cache import ShuffleIndex

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = [f"Record {i}: the quick brown fox {'jumps ' * (i % 5)}over the lazy dog {i}."
         for i in range(40)]


def llama_style_tokenizer(directory: Path, vocab_size: int = 300) -> Path:
    """A tiny byte-level BPE shaped like Llama 3's: bos prepended by its
    post-processor, bos/eos named in tokenizer_config.json."""
    model = tokenizers.Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    model.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, model.token_to_id(BOS))])
    directory.mkdir(parents=True, exist_ok=True)
    model.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": {"content": EOS}}))
    return directory


def write_indexed(prefix: Path, documents: list[list[int]]) -> Path:
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for document in documents:
            writer.add_document(document)
        writer.finalize()
    return prefix


def numbered_documents(prefix: Path, count: int, length: int, first_id: int = 0) -> Path:
    """Document d is `length` copies of token first_id + d: a sample tells its documents."""
    return write_indexed(prefix, [[first_id + d] * length for d in range(count)])


# --- tokenizers -----------------------------------------------------------------------------


def test_hf_tokenizer_from_a_model_directory_and_a_file(tmp_path):
    directory = llama_style_tokenizer(tmp_path / "model")
    tokenizer = build_tokenizer(str(directory))
    ids = tokenizer.encode("the quick brown fox")
    assert ids[0] == tokenizer.bos_id and tokenizer.decode(ids[1:]) == "the quick brown fox"
    assert tokenizer.eod_id == tokenizer.hf_tokenizer().token_to_id(EOS)
    assert tokenizer.special_tokens() == {"eos_token": EOS, "bos_token": BOS}
    # A bare tokenizer.json: the eos token is found by its well-known name.
    assert build_tokenizer(str(directory / "tokenizer.json")).eod_id == tokenizer.eod_id
    with pytest.raises(ValueError, match="data.tokenizer.*Fix"):
        build_tokenizer(str(tmp_path / "nowhere"))


def test_gpt2_tokenizer_exports_an_equivalent_hf_tokenizer():
    gpt2 = build_tokenizer("gpt2")
    hf = gpt2.hf_tokenizer()
    text = "Hello world!  It's 2024 -- naïve café, <tags> and\n\nnew lines."
    assert hf.encode(text).ids == gpt2.encode(text)
    assert hf.token_to_id("<|endoftext|>") == gpt2.eod_id == 50256
    assert hf.get_vocab_size() == gpt2.vocab_size and hf.decode(gpt2.encode(text)) == text


# --- streaming prepare ----------------------------------------------------------------------


def jsonl_corpus(path: Path) -> Path:
    lines = [json.dumps({"id": i, "body": text}) for i, text in enumerate(TEXTS)]
    lines.insert(3, json.dumps({"id": "empty", "body": ""}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_prepare_jsonl_in_worker_processes_matches_one_process(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("megaresil.data.prepare._BATCH_CHARACTERS", 200)  # many small tasks
    corpus, tokenizer = jsonl_corpus(tmp_path / "c.jsonl"), llama_style_tokenizer(tmp_path / "t")
    parallel = prepare_main([str(corpus)], str(tmp_path / "par"), str(tokenizer), json_key="body",
                            workers=2)
    serial = prepare_main([str(corpus)], str(tmp_path / "ser"), str(tokenizer), json_key="body",
                          workers=1)
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"par{suffix}").read_bytes() == (tmp_path / f"ser{suffix}").read_bytes()
    out = capsys.readouterr().out
    assert "prepared 40 documents (1 empty skipped)" in out and "tokens/s" in out
    ds, hf = IndexedDataset(tmp_path / "par"), build_tokenizer(str(tokenizer))
    assert (parallel.documents, parallel.tokens) == (len(ds), ds.num_tokens) == (40, serial.tokens)
    assert ds[5].tolist() == hf.encode(TEXTS[5]) + [hf.eod_id]  # bos + text + eod


def test_prepare_reads_text_files_in_order_and_trains_bpe(tmp_path):
    files = [tmp_path / f"{name}.txt" for name in ("a", "b")]
    for i, file in enumerate(files):
        file.write_text("\n\n\n".join(TEXTS[i * 3:i * 3 + 3]), encoding="utf-8")
    summary = prepare_main([str(f) for f in files], str(tmp_path / "out"), "bpe", vocab_size=280,
                           workers=1)
    tokenizer = build_tokenizer("bpe", cache_path=summary.tokenizer_path)
    ds = IndexedDataset(tmp_path / "out")
    assert [tokenizer.decode(ds[i][:-1].tolist()) for i in range(len(ds))] == \
        [text + "\n" for text in TEXTS[:6]]
    assert all(int(ds[i][-1]) == tokenizer.eod_id for i in range(len(ds)))


def test_prepare_names_a_bad_json_line(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"c.jsonl:2 has no string field 'text'.*--json-key"):
        prepare_main([str(corpus)], str(tmp_path / "out"), "byte", workers=1)
    assert not (tmp_path / "out.bin").exists()


# --- blends ---------------------------------------------------------------------------------


def test_blend_weights_follow_megatrons_convention():
    assert parse_blend([0.7, "a", 0.3, "b"]) == [(0.7, "a"), (0.3, "b")]
    assert parse_blend([2, "a", 6, "b"]) == [(0.25, "a"), (0.75, "b")]
    assert parse_blend(["a", "b"]) == [(0.5, "a"), (0.5, "b")]
    for bad in ([0.7, "a", 0.3], ["a", 0.3], [0.0, "a", 1.0, "b"]):
        with pytest.raises(ConfigError, match="data.paths"):
            parse_blend(bad)
    assert counts_per_period([1 / 3] * 3).tolist() == [3334, 3333, 3333]


class Labelled:
    """Sample i of dataset `name` is (name, i)."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, index: int):
        return self.name, index


def test_blend_interleaves_by_weight_and_visits_each_dataset_in_order():
    blend = BlendedDataset([Labelled("a"), Labelled("b")], [0.7, 0.3])
    samples = [blend[i] for i in range(2 * PERIOD + 100)]
    for name, share in (("a", 0.7), ("b", 0.3)):
        indices = [index for owner, index in samples if owner == name]
        assert indices == list(range(len(indices)))  # each dataset's own order, none skipped
        assert abs(len(indices) - share * len(samples)) <= 2
    first_ten = [owner for owner, _ in samples[:10]]
    assert first_ten.count("a") == 7  # even within a global batch, not a run of a's then b's
    assert blend[123_456_789] == BlendedDataset([Labelled("a"), Labelled("b")], [0.7, 0.3])[123_456_789]


# --- splits ---------------------------------------------------------------------------------


# Data written here has no record of its tokenizer (as Megatron's data): the
# recipe names one, byte (257 ids), for models of VOCAB ids.
VOCAB = 300


def config(**kwargs) -> DataConfig:
    return DataConfig(source="indexed", seq_len=4, **{"tokenizer": "byte", **kwargs})


def documents_seen(dataset, samples: int) -> set[int]:
    return {int(t) for i in range(samples) for t in dataset[i][0]}


def test_without_a_valid_prefix_eval_reads_only_held_out_documents(tmp_path):
    prefix = numbered_documents(tmp_path / "ds", count=50, length=9)
    train, valid, _ = build_datasets(config(path=str(prefix), valid_fraction=0.1), VOCAB, 0)
    seen_train, seen_valid = documents_seen(train, 200), documents_seen(valid, 20)
    assert seen_valid <= set(range(45, 50)) and seen_train <= set(range(45))
    assert len(seen_train) == 45  # an epoch of train covers every train document


def test_megatron_style_split_and_valid_prefix(tmp_path):
    prefix = numbered_documents(tmp_path / "ds", count=100, length=9)
    assert split_documents(100, [0.969, 0.03, 0.001]) == [0, 97, 100, 100]
    assert split_documents(1000, [0.969, 0.03, 0.001]) == [0, 969, 999, 1000]
    train, valid, _ = build_datasets(config(path=str(prefix), split="80,15,5"), VOCAB, 0)
    assert documents_seen(valid, 40) == set(range(80, 95))
    assert documents_seen(train, 300) == set(range(80))
    # A PREFIX_valid is the valid set unless data.split asks for a split.
    numbered_documents(tmp_path / "ds_valid", count=3, length=9, first_id=200)
    _, valid, _ = build_datasets(config(path=str(prefix)), VOCAB, 0)
    assert documents_seen(valid, 10) == {200, 201, 202}


def test_a_split_without_valid_documents_is_refused_when_eval_needs_them(tmp_path):
    prefix = numbered_documents(tmp_path / "ds", count=10, length=9)
    cfg = config(path=str(prefix), split="100,0,0")
    with pytest.raises(ConfigError, match="data.split.*no valid documents.*eval_batches=0"):
        build_datasets(cfg, VOCAB, 0)
    assert build_datasets(cfg, VOCAB, 0, need_valid=False)[1] is None
    with pytest.raises(ConfigError, match="data.split"):
        build_datasets(config(path=str(prefix), split="a,b"), VOCAB, 0)


def test_blended_valid_set_holds_only_each_datasets_valid_documents(tmp_path):
    a = numbered_documents(tmp_path / "a", count=20, length=9)
    b = numbered_documents(tmp_path / "b", count=20, length=9, first_id=100)
    train, valid, _ = build_datasets(config(paths=[0.7, str(a), 0.3, str(b)], split="90,10,0"),
                                     VOCAB, 0)
    assert documents_seen(valid, 50) == {18, 19, 118, 119}
    assert documents_seen(train, 400) == set(range(18)) | set(range(100, 118))


def test_recipe_keys_for_blends_are_validated():
    with pytest.raises(ConfigError, match="data.path.*not both"):
        load_recipe("recipes/gpt-tiny.yaml", ["data.source=indexed", "data.path=a",
                                              "data.paths=[0.5, a, 0.5, b]"])
    with pytest.raises(ConfigError, match="data.source.*indexed"):
        load_recipe("recipes/gpt-tiny.yaml", ["data.paths=[0.5, a, 0.5, b]"])
    cfg = load_recipe("recipes/gpt-tiny.yaml", ["data.source=indexed", "data.paths=[0.5, a, 0.5, b]"])
    assert list(cfg.data.paths) == [0.5, "a", 0.5, "b"]


def test_ids_beyond_the_model_vocabulary_are_refused_when_read(tmp_path):
    prefix = write_indexed(tmp_path / "ds", [[1, 2, 3, 4, 5, 6, 7, 8, 500, 9]])
    train, _, _ = build_datasets(config(path=str(prefix), split="1,0,0"), VOCAB, 0,
                                 need_valid=False)
    with pytest.raises(ValueError, match="model.vocab_size.*500"):
        [train[i] for i in range(2)]


def test_recipe_tokenizer_is_the_one_the_data_was_made_with(tmp_path):
    directory = llama_style_tokenizer(tmp_path / "t")
    cfg = config(path="unused", tokenizer=str(directory))
    assert recipe_tokenizer(cfg, 300).special_tokens()["eos_token"] == EOS


# --- shuffle-index cache --------------------------------------------------------------------


def test_shuffle_order_is_built_once_then_memory_mapped(tmp_path, monkeypatch):
    prefix = numbered_documents(tmp_path / "ds", count=30, length=9)
    cfg = config(path=str(prefix), split="1,0,0")
    first, _, _ = build_datasets(cfg, VOCAB, 7, need_valid=False)
    order = np.asarray(first.shuffle.epoch(0))
    assert order.tolist() == np.random.default_rng([7, 0]).permutation(
        first.samples_per_epoch).tolist()  # the order the in-RAM dataset used

    def refuse(*args):
        raise AssertionError("rebuilt a cached shuffle order")

    monkeypatch.setattr(ShuffleIndex, "_build", refuse)
    again, _, _ = build_datasets(cfg, VOCAB, 7, need_valid=False)
    assert isinstance(again.shuffle.epoch(0), np.memmap)
    assert [again[i][0].tolist() for i in range(10)] == [first[i][0].tolist() for i in range(10)]
    # Other inputs, other order: a changed seq_len changes the sample count and the key.
    monkeypatch.undo()
    other, _, _ = build_datasets(replace(cfg, seq_len=8), VOCAB, 7, need_valid=False)
    assert other.shuffle.key != first.shuffle.key


def _first_sample(prefix: str, index_dir: str, results) -> None:
    dataset = GPTDataset(IndexedDataset(prefix), 4, 3, index_dir=index_dir)
    results.put((os.getpid(), dataset[0][0].tolist()))


def test_concurrent_ranks_build_the_shuffle_order_once(tmp_path, monkeypatch):
    prefix = numbered_documents(tmp_path / "ds", count=30, length=9)
    builds = tmp_path / "builds.log"
    original = ShuffleIndex._build

    def counting_build(self, epoch, path):
        with open(builds, "a") as log:
            log.write(f"{os.getpid()}\n")
        original(self, epoch, path)

    monkeypatch.setattr(ShuffleIndex, "_build", counting_build)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=_first_sample,
                               args=(str(prefix), str(tmp_path / "index"), results))
               for _ in range(3)]
    for worker in workers:
        worker.start()
    samples = [results.get(timeout=60)[1] for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert len(builds.read_text().split()) == 1 and samples[0] == samples[1] == samples[2]
    assert [p.name for p in (tmp_path / "index").iterdir() if p.suffix == ".npy"] != []
