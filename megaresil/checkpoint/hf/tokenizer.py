"""The tokenizer files of a Hugging Face export: `tokenizer.json`,
`tokenizer_config.json` and `special_tokens_map.json`, so that
`AutoTokenizer.from_pretrained(DIR)` loads the tokenizer the model was
trained with.

Which tokenizer: the recipe's `data.tokenizer` (or the export's --tokenizer):
a `tokenizer.json` file or a model directory holding one (its
tokenizer_config.json and special_tokens_map.json are carried over), or one
of megaresil's own: 'gpt2' (GPT-2's BPE files), 'bpe' (the one trained on the
corpus, from the data cache) and 'byte' (written as a byte-level BPE without
merges, which encodes exactly like it). bos/eos are the model's
`bos_token_id`/`eos_token_id`, or the tokenizer's own (its config's, else
megaresil's end-of-document token), and must name the same tokens in the
tokenizer and in config.json.
"""
# mypy: ignore-errors
from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import tokenizers

from megaresil.checkpoint.format import CheckpointError
from megaresil.config import ConfigError, DataConfig, ModelConfig
from megaresil.data.tokenizer import ENDOFTEXT, read_tokenizer_file

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = "special_tokens_map.json"
# Files of a model directory's tokenizer that travel with it unchanged.
CARRIED = ("special_tokens_map.json", "chat_template.jinja")


@dataclass
class ExportTokenizer:
    tokenizer: tokenizers.Tokenizer
    config: dict = field(default_factory=dict)  # tokenizer_config.json, when the source had one
    directory: Optional[Path] = None  # a model directory it came from

    def token_for(self, role: str) -> Optional[int]:
        """The id of the tokenizer's own `role` ('bos'/'eos') token: its
        config's, else megaresil's end-of-document token (GPT-2 style)."""
        token = self.config.get(f"{role}_token")
        text = token.get("content") if isinstance(token, dict) else token
        return self.tokenizer.token_to_id(text or ENDOFTEXT)


def _from_path(path: Path) -> ExportTokenizer:
    if path.is_file():
        return ExportTokenizer(read_tokenizer_file(path))
    if not (path / TOKENIZER).is_file():
        raise CheckpointError(f"{path} has no {TOKENIZER}. Fix: give a directory written by a "
                              "fast tokenizer's save_pretrained, or a tokenizer.json file.")
    config = path / TOKENIZER_CONFIG
    try:
        carried = json.loads(config.read_text()) if config.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config} is not valid JSON ({err}). Fix: re-save the "
                              "tokenizer with save_pretrained.") from None
    return ExportTokenizer(read_tokenizer_file(path / TOKENIZER), carried, path)


def check_hf_tokenizer(directory: Path, model_vocab: int) -> bool:
    """Whether a model directory has a tokenizer, read in full (with its
    tokenizer_config.json) before anything uses it: an error naming the file
    when one is malformed, or when it holds more tokens than the model has ids."""
    if not (directory / TOKENIZER).is_file():
        return False
    size = _from_path(directory).tokenizer.get_vocab_size()
    if size > model_vocab:
        raise ConfigError("data.tokenizer", f"{directory / TOKENIZER} has {size} tokens, but "
                          f"{directory / 'config.json'} gives the model {model_vocab} ids.",
                          "use the tokenizer saved with this model.")
    return True


def load_export_tokenizer(spec: Optional[str], data: DataConfig,
                          model_vocab: int) -> Optional[ExportTokenizer]:
    """The tokenizer `spec` names (None: the one the recipe's data.tokenizer
    means); None for synthetic data, which has none."""
    from megaresil.data import recipe_tokenizer
    from megaresil.data.provenance import tokenizer_spec

    spec = tokenizer_spec(data) if spec is None else spec
    if Path(spec).exists():
        return _from_path(Path(spec))
    if data.source == "synthetic":
        return None
    try:
        tokenizer = recipe_tokenizer(dataclasses.replace(data, tokenizer=spec), model_vocab)
        return ExportTokenizer(tokenizer.hf_tokenizer())
    except ValueError as err:  # the data package's own message names its fix
        raise CheckpointError(str(err)) from None


def export_token_ids(model: ModelConfig,
                     tokenizer: Optional[ExportTokenizer]) -> tuple[Optional[int], Optional[int]]:
    """(bos, eos) for config.json: the model's, else the tokenizer's."""
    def pick(role: str) -> Optional[int]:
        given = getattr(model, f"{role}_token_id")
        return given if given is not None or tokenizer is None else tokenizer.token_for(role)
    return pick("bos"), pick("eos")


def _token_text(tokenizer: tokenizers.Tokenizer, token_id: Optional[int], role: str) -> Optional[str]:
    if token_id is None:
        return None
    text = tokenizer.id_to_token(token_id)
    if text is None:
        raise CheckpointError(f"model.{role}_token_id={token_id} is not a token of the "
                              f"exported tokenizer. Fix: set model.{role}_token_id to one of "
                              "its ids (or --tokenizer to the model's tokenizer).")
    return text


def _check_config_tokens(config: dict, texts: dict[str, Optional[str]]) -> None:
    """A carried tokenizer_config.json must name the model's bos/eos tokens."""
    for role, text in texts.items():
        token = config.get(f"{role}_token")
        named = token.get("content") if isinstance(token, dict) else token
        if named is not None and text is not None and named != text:
            raise CheckpointError(f"{TOKENIZER_CONFIG} names {role}_token {named!r}, the model's "
                                  f"{role}_token_id is {text!r}. Fix: set model.{role}_token_id "
                                  "to the tokenizer's id for it.")


def write_tokenizer(out: Path, tok: ExportTokenizer, model: ModelConfig, bos: Optional[int],
                    eos: Optional[int]) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json in `out`."""
    size = tok.tokenizer.get_vocab_size(with_added_tokens=True)
    if size > model.vocab_size:
        raise CheckpointError(f"the tokenizer has {size} tokens, the model {model.vocab_size}. "
                              "Fix: pass --tokenizer naming the tokenizer it was trained with.")
    texts = {"bos": _token_text(tok.tokenizer, bos, "bos"),
             "eos": _token_text(tok.tokenizer, eos, "eos")}
    _check_config_tokens(tok.config, texts)
    tok.tokenizer.save(str(out / TOKENIZER))
    specials = {f"{role}_token": text for role, text in texts.items() if text is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.max_seq_len,
              "clean_up_tokenization_spaces": False, **tok.config, **specials}
    (out / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    carried = [name for name in CARRIED if tok.directory and (tok.directory / name).is_file()]
    for name in carried:
        shutil.copyfile(tok.directory / name, out / name)
    if SPECIAL_TOKENS not in carried:
        (out / SPECIAL_TOKENS).write_text(json.dumps(specials, indent=2) + "\n")
