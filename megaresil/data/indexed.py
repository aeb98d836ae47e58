"""Megatron-LM's indexed dataset: PREFIX.bin (tokens) + PREFIX.idx (index).

Byte-compatible with `megatron/core/datasets/indexed_dataset.py` (index
version 1, not multimodal), so data prepared here trains in Megatron-LM and
vice versa; one document is one sequence. The .idx layout, byte by byte:
docs/data.md, "How it works".
"""
from __future__ import annotations

import array
import os
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from megaresil.safe_files import fresh_file_beside, write_atomic

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[type, int] = {
    np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4,
    np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8,
}
_PREAMBLE = struct.Struct("<9sQBQQ")  # header, version, dtype code, sequences, documents


def bin_path(prefix: str | Path) -> str:
    return f"{prefix}.bin"


def idx_path(prefix: str | Path) -> str:
    return f"{prefix}.idx"


def exists(prefix: str | Path) -> bool:
    return os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))


def dtype_for_vocab(vocab_size: int) -> type:
    """Megatron's rule: 2-byte tokens when the vocabulary allows it."""
    return np.uint16 if vocab_size < 65500 else np.int32


class IndexedDatasetWriter:
    """Writes PREFIX.bin/.idx; nothing appears under the final names until
    `finalize`, so a killed writer never leaves a half dataset behind."""

    def __init__(self, prefix: str | Path, dtype: type | np.dtype = np.int32):
        self.dtype: type = np.dtype(dtype).type
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype {dtype} has no Megatron code; use one of "
                             f"{[d.__name__ for d in DTYPE_CODES]}.")
        self.prefix = str(prefix)
        self._bin, self._bin_temp = fresh_file_beside(Path(bin_path(self.prefix)))
        self._lengths = array.array("q")  # 8 bytes a document, not a Python int each

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        ids = self._checked_array(tokens)
        self._bin.write(ids.tobytes(order="C"))
        self._lengths.append(ids.size)

    def _checked_array(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        array = np.asarray(tokens)
        if array.size and np.issubdtype(self.dtype, np.integer):
            # A silent wrap-around would corrupt the corpus without any error.
            limits = np.iinfo(self.dtype)
            if array.min() < limits.min or array.max() > limits.max:
                raise ValueError(f"token ids {array.min()}..{array.max()} do not fit "
                                 f"{self.dtype.__name__}; write with a wider dtype.")
        return array.astype(self.dtype, copy=False).ravel()

    def finalize(self) -> None:
        self._bin.close()
        os.replace(self._bin_temp, bin_path(self.prefix))
        write_atomic(Path(idx_path(self.prefix)), self._index_bytes())

    def _index_bytes(self) -> bytes:
        lengths = np.frombuffer(self._lengths, dtype=np.int64).astype(np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(self.dtype).itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)
        preamble = _PREAMBLE.pack(HEADER, VERSION, DTYPE_CODES[self.dtype],
                                  len(lengths), len(documents))
        return preamble + lengths.tobytes() + pointers.tobytes() + documents.tobytes()

    def discard(self) -> None:
        self._bin.close()
        self._bin_temp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()


class IndexedDataset:
    """Memory-mapped reader: `ds[i]` is sequence i as a read-only numpy view."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        if not exists(self.prefix):
            raise FileNotFoundError(f"indexed dataset {self.prefix}.bin/.idx not found.")
        self._open()

    def _open(self) -> None:
        index = np.memmap(idx_path(self.prefix), dtype=np.uint8, mode="r")
        code, sequences, documents = self._parse_preamble(bytes(index[:_PREAMBLE.size]))
        self.dtype: type = next(d for d, c in DTYPE_CODES.items() if c == code)
        offset = _PREAMBLE.size
        self.sequence_lengths = np.frombuffer(index, np.int32, sequences, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(index, np.int64, sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(index, np.int64, documents, offset)
        self._tokens = self._map_tokens()

    def _parse_preamble(self, preamble: bytes) -> tuple[int, int, int]:
        header, version, code, sequences, documents = _PREAMBLE.unpack(preamble)
        if header != HEADER or version != VERSION or code not in DTYPE_CODES.values():
            raise ValueError(f"{idx_path(self.prefix)} is not a Megatron indexed dataset "
                             f"(version {VERSION}); re-create it with `megaresil data prepare`.")
        return code, sequences, documents

    def _map_tokens(self) -> np.ndarray:
        expected = int(self.sequence_lengths.sum(dtype=np.int64))
        size = os.path.getsize(bin_path(self.prefix)) // np.dtype(self.dtype).itemsize
        if size != expected:
            raise ValueError(f"{bin_path(self.prefix)} holds {size} tokens but its index "
                             f"expects {expected}; the file is truncated or mismatched.")
        if expected == 0:
            return np.empty(0, dtype=self.dtype)  # mmap refuses empty files
        return np.memmap(bin_path(self.prefix), dtype=self.dtype, mode="r")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // np.dtype(self.dtype).itemsize
        return self._tokens[start:start + int(self.sequence_lengths[i])]

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def document_tokens(self, first: int, last: int) -> tuple[int, int]:
        """[start, end) in the token stream of documents [first, last)."""
        return self._sequence_start(int(self.document_indices[first])), \
            self._sequence_start(int(self.document_indices[last]))

    def _sequence_start(self, sequence: int) -> int:
        if sequence == len(self.sequence_pointers):
            return self.num_tokens
        return int(self.sequence_pointers[sequence]) // np.dtype(self.dtype).itemsize

    def tokens(self) -> np.ndarray:
        """All tokens of the .bin in order, as one flat memmap."""
        return self._tokens

    # Pickle by path: the default would copy the whole memmap into the pickle.
    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()
