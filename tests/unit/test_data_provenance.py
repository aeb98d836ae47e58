"""Issue 47 item 2: `data prepare` records which tokenizer made the data
(PREFIX.prepared.json); a recipe takes the recorded tokenizer when
data.tokenizer is unset and refuses another one at start."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megaresil.config import ConfigError, DataConfig
from megaresil.data import IndexedDatasetWriter, build_datasets, build_tokenizer, recipe_tokenizer
from megaresil.data.prepare import prepare_main
from megaresil.data.provenance import record_path
from tests.unit.test_data_blend import llama_style_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog, and the dog sleeps on"


def prepared(tmp_path: Path, name: str, tokenizer: str, documents: int = 60) -> str:
    """PREFIX of a small JSON Lines corpus prepared with `tokenizer`."""
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"{i}: {TEXT} {i}."}) + "\n"
                              for i in range(documents)))
    prefix = tmp_path / "data" / name
    prepare_main([str(corpus)], str(prefix), tokenizer, workers=1, vocab_size=300)
    return str(prefix)


def indexed(*prefixes: str, **kwargs) -> DataConfig:
    where = {"path": prefixes[0]} if len(prefixes) == 1 else {"paths": list(prefixes)}
    return DataConfig(source="indexed", seq_len=8, **where, **kwargs)


def test_an_unset_tokenizer_is_the_one_the_data_was_prepared_with(tmp_path):
    tokenizer = llama_style_tokenizer(tmp_path / "tokenizer")
    prefix = prepared(tmp_path, "c", str(tokenizer))
    assert json.loads(record_path(prefix).read_text())["tokenizer"] == str(tokenizer.resolve())
    ids = recipe_tokenizer(indexed(prefix), 300).encode(TEXT)
    assert ids == build_tokenizer(str(tokenizer)).encode(TEXT)
    build_datasets(indexed(prefix), 300, 0)  # checked and taken, from another directory too
    with pytest.raises(ConfigError, match=f"{prefix} was prepared with {tokenizer.resolve()} "
                                          r"\(so says .*\), not bpe"):
        build_datasets(indexed(prefix, tokenizer="bpe"), 300, 0)  # the demo piece's, forgotten


def test_another_tokenizer_is_refused_naming_the_recorded_one(tmp_path):
    prefix = prepared(tmp_path, "c", "byte")
    with pytest.raises(ConfigError) as refused:
        build_datasets(indexed(prefix, tokenizer="gpt2"), 50304, 0)
    assert str(refused.value).startswith(f"data.tokenizer: {prefix} was prepared with byte (so "
                                         f"says {prefix}.prepared.json), not gpt2")
    assert "Fix: set data.tokenizer=byte, or data.tokenizer=null" in str(refused.value)


def test_one_tokenizer_named_by_two_paths_is_one_tokenizer_and_a_blend_needs_one(tmp_path):
    notes = prepared(tmp_path, "notes", "bpe")
    stories = prepared(tmp_path, "stories", f"{notes}_tokenizer.json")
    for tokenizer in (None, "bpe", f"{notes}_tokenizer.json"):
        build_datasets(indexed(notes, stories, tokenizer=tokenizer), 300, 0)
    other = prepared(tmp_path, "other", "byte")
    with pytest.raises(ConfigError, match=f"{other} was prepared with byte .* the prefixes of a "
                                          "blend must all be prepared with one tokenizer"):
        build_datasets(indexed(notes, other), 300, 0)


def test_indexed_data_without_a_record_or_its_bpe_is_refused_at_start(tmp_path):
    """Megatron's data (no record): the default bpe needs PREFIX_tokenizer.json,
    as troubleshooting.md says, before any step (it used to train to the end)."""
    prefix = tmp_path / "megatron"
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for start in range(0, 200, 20):
            writer.add_document(list(range(start, start + 20)))
        writer.finalize()
    with pytest.raises(ConfigError, match=f"data.tokenizer: 'bpe' indexed data needs the trained "
                                          f"tokenizer {prefix}_tokenizer.json, which is missing"):
        build_datasets(indexed(str(prefix)), 300, 0)
    build_datasets(indexed(str(prefix), tokenizer="byte"), 300, 0, need_valid=False)


def test_a_recorded_tokenizer_that_moved_is_named(tmp_path):
    tokenizer = llama_style_tokenizer(tmp_path / "tokenizer")
    prefix = prepared(tmp_path, "c", str(tokenizer))
    tokenizer.rename(tmp_path / "moved")
    with pytest.raises(ConfigError, match=f"was prepared with {tokenizer.resolve()} .* which is "
                                          "not there any more"):
        build_datasets(indexed(prefix), 300, 0)
    build_datasets(indexed(prefix, tokenizer=str(tmp_path / "moved")), 300, 0)
