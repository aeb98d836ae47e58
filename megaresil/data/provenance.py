"""Which tokenizer made a prepared dataset. `megaresil data prepare` records
it beside PREFIX.idx, in PREFIX.prepared.json; a recipe reads it back: an
unset `data.tokenizer` is the recorded one, and one that names another
tokenizer is refused before any worker starts (the data's token ids would be
read as another tokenizer's text, by generation and export after the run).
Data without a record (Megatron's, or prepared by an earlier megaresil) is
taken as `data.tokenizer` says. docs/data.md, "Tokenizers"."""
# mypy: ignore-errors
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional, Sequence

from megaresil.config import ConfigError, DataConfig
from megaresil.data.blend import parse_blend
from megaresil.data.tokenizer import hf_tokenizer_file
from megaresil.safe_files import write_atomic

RECORD_SUFFIX = ".prepared.json"
RECORD_FORMAT = 1
NAMED = ("gpt2", "byte")  # tokenizers known by their name alone (no file)


@dataclass(frozen=True)
class Prepared:
    tokenizer: str  # as data.tokenizer names it: bpe, gpt2, byte, or an absolute path
    identity: str  # gpt2, byte, or sha256:HEX of its tokenizer.json: equal for equal tokenizers


def record_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{RECORD_SUFFIX}")


def bpe_file(prefix: str | Path) -> Path:
    """PREFIX_tokenizer.json: the BPE `data prepare --tokenizer bpe` trains,
    which `data.tokenizer=bpe` reads for indexed data."""
    return Path(f"{prefix}_tokenizer.json")


def tokenizer_identity(spec: str, prefix: str | Path) -> str:
    """What tells two tokenizers apart: the name of a built-in one, else the
    digest of its tokenizer.json ('bpe': the prefix's own), so one tokenizer
    named by two paths is one tokenizer."""
    if spec in NAMED:
        return spec
    file = bpe_file(prefix) if spec == "bpe" else hf_tokenizer_file(Path(spec))
    return "sha256:" + hashlib.sha256(file.read_bytes()).hexdigest()


def record(prefix: str | Path, spec: str) -> None:
    """Write PREFIX.prepared.json for data just prepared with `spec` (a path
    is recorded absolute: training starts from other directories)."""
    named = spec if spec == "bpe" or spec in NAMED else str(Path(spec).resolve())
    prepared = Prepared(named, tokenizer_identity(spec, prefix))
    write_atomic(record_path(prefix),
                 json.dumps({"format": RECORD_FORMAT, **asdict(prepared)}, indent=1) + "\n")


def read_record(prefix: str | Path) -> Optional[Prepared]:
    """The prefix's record; None when it has none."""
    path = record_path(prefix)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Prepared(str(data["tokenizer"]), str(data["identity"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError("data.tokenizer", f"{path} cannot be read ({err!r}).",
                          "prepare the data again, or delete the file and set data.tokenizer "
                          "to the tokenizer the data was prepared with.") from None


def tokenizer_spec(data_cfg: DataConfig) -> str:
    """The tokenizer data.tokenizer means: as given; unset, the one the
    first prefix of indexed data was prepared with (its record), else bpe."""
    if data_cfg.tokenizer is not None:
        return data_cfg.tokenizer
    if data_cfg.source != "indexed":
        return "bpe"
    first = parse_blend(data_cfg.paths)[0][1] if data_cfg.paths else data_cfg.path or ""
    return recorded_tokenizer(first) or "bpe"


def recorded_tokenizer(prefix: str) -> Optional[str]:
    """The tokenizer the prefix's record names (as data.tokenizer would);
    None without a record."""
    prepared = read_record(prefix)
    if prepared is None:
        return None
    if prepared.tokenizer not in ("bpe", *NAMED) and not Path(prepared.tokenizer).exists():
        raise ConfigError("data.tokenizer", f"{prefix} was prepared with {prepared.tokenizer} "
                          f"(so says {record_path(prefix)}), which is not there any more.",
                          "set data.tokenizer to that tokenizer where it is now (its "
                          "tokenizer.json or model directory).")
    return prepared.tokenizer


def check_prepared_with(spec: str, blend: Sequence[str]) -> None:
    """Refuse a tokenizer other than the one each recorded prefix was made
    with (`blend`: the prefixes, the first one's PREFIX_tokenizer.json is
    'bpe'). A tokenizer that is not there is another one, unless the record
    names it as `spec` does: its own refusal, naming the file, follows."""
    recorded = [(prefix, read_record(prefix)) for prefix in blend]
    recorded = [(prefix, prepared) for prefix, prepared in recorded if prepared is not None]
    if not recorded:
        return
    try:
        identity: Optional[str] = tokenizer_identity(spec, blend[0])
    except (OSError, ConfigError):
        identity = None
    for prefix, prepared in recorded:
        if prepared.identity == identity or (identity is None and prepared.tokenizer == spec):
            continue
        one = "; the prefixes of a blend must all be prepared with one tokenizer" \
            if len(blend) > 1 else ""
        raise ConfigError("data.tokenizer", f"{prefix} was prepared with {prepared.tokenizer} "
                          f"(so says {record_path(prefix)}), not {spec}: its token ids would "
                          "be read as another tokenizer's.",
                          f"set data.tokenizer={prepared.tokenizer}, or data.tokenizer=null "
                          f"(the tokenizer the data was prepared with){one}.")
