"""Data start-up cost: time and peak RSS to get a rank's train and valid
datasets ready, on synthetic Megatron corpora of 1 GB and 10 GB.

Compared side by side in one run, each case in a fresh process with the
corpus evicted from the page cache first (posix_fadvise DONTNEED on its
files, so the disk is read as on a first start):

  old      the path before the index cache, replayed here (that code is gone
           from megaresil/data): the .bin scanned for its largest token id
           (once for train, once for valid, which was the same prefix when no
           PREFIX_valid existed) and the epoch's shuffle built in RAM;
  cold     megaresil's build_datasets with an empty index cache: it builds
           and writes the shuffle orders (train and valid split);
  cached   build_datasets again: it maps the cached orders.

The corpora are written directly as .bin/.idx (random uint16 tokens, document
lengths drawn around 1,000 tokens), not tokenized, and deleted afterwards.
Usage: python bench/data_startup.py [--sizes-gb 1 10] [--seq-len 128] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from megaresil.data.indexed import DTYPE_CODES, _PREAMBLE, HEADER, VERSION

CHUNK_TOKENS = 1 << 25  # 64 MB of uint16 written per call


def write_corpus(prefix: Path, size_bytes: int, seed: int = 0) -> int:
    """A uint16 corpus of about `size_bytes`; returns its document count."""
    rng = np.random.default_rng(seed)
    tokens = size_bytes // 2
    lengths = rng.integers(200, 1800, size=tokens // 1000 + 1, dtype=np.int64)
    lengths = lengths[np.cumsum(lengths) <= tokens]
    lengths[-1] += tokens - int(lengths.sum())
    chunk = rng.integers(0, 50257, size=CHUNK_TOKENS, dtype=np.uint16)
    with open(f"{prefix}.bin", "wb") as handle:
        for start in range(0, tokens, CHUNK_TOKENS):
            handle.write(chunk[:min(CHUNK_TOKENS, tokens - start)].tobytes())
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1] * 2, out=pointers[1:])
    with open(f"{prefix}.idx", "wb") as handle:
        handle.write(_PREAMBLE.pack(HEADER, VERSION, DTYPE_CODES[np.uint16], len(lengths),
                                    len(lengths) + 1))
        handle.write(lengths.astype(np.int32).tobytes())
        handle.write(pointers.tobytes())
        handle.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
    return len(lengths)


def evict(prefix: Path) -> None:
    for suffix in (".bin", ".idx"):
        fd = os.open(f"{prefix}{suffix}", os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def old_startup(prefix: str, seq_len: int, seed: int) -> tuple:
    """What every rank did before: existing_indexed + GPTDataset's first permutation."""
    from megaresil.data.indexed import IndexedDataset

    train, valid = IndexedDataset(prefix), IndexedDataset(prefix)  # no PREFIX_valid
    vocab = max(int(np.max(train.tokens())), int(np.max(valid.tokens()))) + 1
    samples = (train.num_tokens - 1) // seq_len
    order = np.random.default_rng([seed, 0]).permutation(samples)
    assert vocab > 0 and len(order) == samples
    return train, valid, order


def new_startup(prefix: str, seq_len: int, seed: int, index_dir: str) -> tuple:
    from megaresil.config import DataConfig
    from megaresil.data import build_datasets

    cfg = DataConfig(source="indexed", path=prefix, seq_len=seq_len, index_cache=index_dir)
    train, valid, _ = build_datasets(cfg, model_vocab_size=50304, seed=seed)
    train[0], valid[0]
    return train, valid


def child(args: argparse.Namespace) -> None:
    process = psutil.Process()
    before = process.memory_info().rss  # after the imports
    start = time.perf_counter()
    if args.case == "old":
        ready = old_startup(args.prefix, args.seq_len, 1234)
    else:
        ready = new_startup(args.prefix, args.seq_len, 1234, args.index_dir)
    seconds = time.perf_counter() - start
    # Resident memory with the datasets ready, mapped pages of the corpus and
    # of the index included (they are what a scan or a permutation leaves behind).
    after = process.memory_info().rss
    print(json.dumps({"seconds": seconds, "rss_mb": after / 2**20,
                      "rss_growth_mb": (after - before) / 2**20}))
    del ready


def measure(case: str, prefix: Path, seq_len: int, index_dir: Path) -> dict:
    evict(prefix)
    # The interpreter and numpy/torch imports are paid before the clock starts.
    out = subprocess.run([sys.executable, __file__, "--child", case, "--prefix", str(prefix),
                          "--seq-len", str(seq_len), "--index-dir", str(index_dir)],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(sizes_gb: list[float], seq_len: int, out: Path, workdir: Path) -> dict:
    rows = []
    for size in sizes_gb:
        directory = Path(tempfile.mkdtemp(prefix="data_startup_", dir=workdir))
        prefix = directory / "corpus"
        try:
            written = time.perf_counter()
            documents = write_corpus(prefix, int(size * 1e9))
            written = time.perf_counter() - written
            index_dir = directory / "index"
            for case in ("old", "cold", "cached"):
                result = measure(case, prefix, seq_len, index_dir)
                rows.append({"size_gb": size, "case": case, "documents": documents,
                             "seq_len": seq_len, **result})
                print(json.dumps(rows[-1]), flush=True)
            index_bytes = sum(p.stat().st_size for p in index_dir.iterdir() if p.suffix == ".npy")
            rows[-1]["index_cache_mb"] = index_bytes / 1e6
            print(f"  ({size} GB corpus written in {written:.0f} s)", flush=True)
        finally:
            for path in sorted(directory.rglob("*"), reverse=True):
                path.rmdir() if path.is_dir() else path.unlink()
            directory.rmdir()
    report = {"rows": rows, "note": "2-core machine shared with other agents' work; each case "
              "in a fresh process after evicting the corpus from the page cache; times exclude "
              "interpreter start and imports; RSS growth is the resident memory the start-up added "
              "(mapped corpus and index pages included)."}
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_startup.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "data_startup.md").write_text(markdown(rows, report["note"]))
    return report


def markdown(rows: list[dict], note: str) -> str:
    lines = ["| corpus | documents | case | start-up (s) | RSS growth (MB) | RSS (MB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['size_gb']:g} GB | {row['documents']:,} | {row['case']} | "
                     f"{row['seconds']:.2f} | {row['rss_growth_mb']:.0f} | {row['rss_mb']:.0f} |")
    return "\n".join(lines) + f"\n\nseq_len {rows[0]['seq_len']}. {note}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[1.0, 10.0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--child", choices=["old", "cold", "cached"])
    parser.add_argument("--prefix")
    parser.add_argument("--index-dir")
    args = parser.parse_args()
    if args.child:
        args.case = args.child
        child(args)
        return
    run(args.sizes_gb, args.seq_len, args.out, args.workdir)


if __name__ == "__main__":
    main()
