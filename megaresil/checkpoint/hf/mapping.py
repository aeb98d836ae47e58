"""Name, layout and config mapping between megaresil and Hugging Face
`transformers` (GPT2LMHeadModel, LlamaForCausalLM), both ways.

Works on full (unsharded, unpadded-vocab) tensors; the resharding path takes
it from there.
"""
# mypy: ignore-errors
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch

from megaresil.checkpoint.format import CheckpointError
from megaresil.config import Flavour, ModelConfig, RopeScalingType
from megaresil.model.gpt import ties_embeddings
from megaresil.model.layers import ffn_size


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
             num_kv_heads: int) -> torch.Tensor:
    """Stack separate q/k/v rows into megaresil's kv-group-major fused layout."""
    groups = num_kv_heads
    q = q.reshape(groups, num_heads // groups, -1, *q.shape[1:])  # (G, H/G, D, ...)
    k = k.reshape(groups, 1, -1, *k.shape[1:])
    v = v.reshape(groups, 1, -1, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[3:])


def split_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int):
    groups, per_group = num_kv_heads, num_heads // num_kv_heads
    grouped = qkv.reshape(groups, per_group + 2, -1, *qkv.shape[1:])  # (G, H/G+2, D, ...)
    q = grouped[:, :per_group].reshape(-1, *qkv.shape[1:])
    k = grouped[:, per_group].reshape(-1, *qkv.shape[1:])
    v = grouped[:, per_group + 1].reshape(-1, *qkv.shape[1:])
    return q, k, v


@dataclass(frozen=True)
class Mapped:
    """One megaresil tensor, made from Hugging Face tensors `sources` by
    `combine` (which also works on meta tensors, giving shapes unread)."""
    sources: tuple[str, ...]
    combine: Callable[..., torch.Tensor] = lambda t: t


def _transposed(source: str) -> Mapped:
    # GPT-2's Conv1D stores (in, out): transpose to nn.Linear's (out, in).
    return Mapped((source,), lambda t: t.t())


def _gpt2_layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    h, o, heads = f"transformer.h.{i}.", f"layers.{i}.", cfg.num_heads
    fused = lambda t: fuse_qkv(*t.chunk(3, dim=0), heads, heads)  # noqa: E731
    out = {o + "attn.qkv.weight": Mapped((h + "attn.c_attn.weight",), lambda w: fused(w.t())),
           o + "attn.qkv.bias": Mapped((h + "attn.c_attn.bias",), fused)}
    for ours, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                         ("mlp.proj", "mlp.c_proj")):
        out[o + ours + ".weight"] = _transposed(h + theirs + ".weight")
        out[o + ours + ".bias"] = Mapped((h + theirs + ".bias",))
    for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
        out[o + ours + ".weight"] = Mapped((h + theirs + ".weight",))
        out[o + ours + ".bias"] = Mapped((h + theirs + ".bias",))
    return out


def _llama_layer_from_hf(i: int, cfg: ModelConfig) -> dict[str, Mapped]:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    kv = cfg.num_kv_heads or cfg.num_heads
    qkv = tuple(f"{h}self_attn.{name}_proj.weight" for name in "qkv")
    return {
        o + "norm1.weight": Mapped((h + "input_layernorm.weight",)),
        o + "attn.qkv.weight": Mapped(qkv, lambda q, k, v: fuse_qkv(q, k, v, cfg.num_heads, kv)),
        o + "attn.proj.weight": Mapped((h + "self_attn.o_proj.weight",)),
        o + "norm2.weight": Mapped((h + "post_attention_layernorm.weight",)),
        o + "mlp.gate.weight": Mapped((h + "mlp.gate_proj.weight",)),
        o + "mlp.up.weight": Mapped((h + "mlp.up_proj.weight",)),
        o + "mlp.down.weight": Mapped((h + "mlp.down_proj.weight",)),
    }


def hf_mapping(cfg: ModelConfig) -> dict[str, Mapped]:
    """Each of megaresil's full, layout-free tensors, as made from a
    transformers state dict's tensors."""
    if cfg.flavour == Flavour.gpt2:
        out = {"embed.tokens.weight": Mapped(("transformer.wte.weight",)),
               "embed.positions.weight": Mapped(("transformer.wpe.weight",)),
               "norm.weight": Mapped(("transformer.ln_f.weight",)),
               "norm.bias": Mapped(("transformer.ln_f.bias",))}
        layer_fn = _gpt2_layer_from_hf
    else:
        out = {"embed.tokens.weight": Mapped(("model.embed_tokens.weight",)),
               "norm.weight": Mapped(("model.norm.weight",))}
        layer_fn = _llama_layer_from_hf
    if not ties_embeddings(cfg):
        out["head.weight"] = Mapped(("lm_head.weight",))
    for i in range(cfg.num_layers):
        out.update(layer_fn(i, cfg))
    return out


# Tensors a transformers file may hold that are not weights (buffers older
# versions saved); they carry nothing to import.
NOT_WEIGHTS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
TIED_HEAD = "lm_head.weight"


def unused_hf_keys(held: Iterable[str], cfg: ModelConfig) -> list[str]:
    """The weights of a transformers model that the mapping would not use
    (so the model is not the one the config describes), beyond buffers; a
    tied head is the caller's to compare with the embedding."""
    used = {source for m in hf_mapping(cfg).values() for source in m.sources}
    return sorted(key for key in held if key not in used and not key.endswith(NOT_WEIGHTS)
                  and not (key == TIED_HEAD and ties_embeddings(cfg)))


def from_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A transformers state dict → megaresil's full, layout-free state dict."""
    return {key: m.combine(*(sd[source] for source in m.sources))
            for key, m in hf_mapping(cfg).items()}


def _gpt2_layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"transformer.h.{i}.", f"layers.{i}."
    heads = cfg.num_heads
    qkv_weight = torch.cat(split_qkv(ours[o + "attn.qkv.weight"], heads, heads))
    out = {h + "attn.c_attn.weight": qkv_weight.t(),  # Conv1D is (in, out)
           h + "attn.c_attn.bias": torch.cat(split_qkv(ours[o + "attn.qkv.bias"], heads, heads))}
    for ours_name, theirs in (("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"),
                              ("mlp.proj", "mlp.c_proj")):
        out[h + theirs + ".weight"] = ours[o + ours_name + ".weight"].t()
        out[h + theirs + ".bias"] = ours[o + ours_name + ".bias"]
    for ours_name, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
        out[h + theirs + ".weight"] = ours[o + ours_name + ".weight"]
        out[h + theirs + ".bias"] = ours[o + ours_name + ".bias"]
    return out


def _llama_layer_to_hf(ours: dict, i: int, cfg: ModelConfig) -> dict:
    h, o = f"model.layers.{i}.", f"layers.{i}."
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    q, k, v = split_qkv(ours[o + "attn.qkv.weight"], cfg.num_heads, kv_heads)
    return {
        h + "input_layernorm.weight": ours[o + "norm1.weight"],
        h + "self_attn.q_proj.weight": q,
        h + "self_attn.k_proj.weight": k,
        h + "self_attn.v_proj.weight": v,
        h + "self_attn.o_proj.weight": ours[o + "attn.proj.weight"],
        h + "post_attention_layernorm.weight": ours[o + "norm2.weight"],
        h + "mlp.gate_proj.weight": ours[o + "mlp.gate.weight"],
        h + "mlp.up_proj.weight": ours[o + "mlp.up.weight"],
        h + "mlp.down_proj.weight": ours[o + "mlp.down.weight"],
    }


def _top_to_hf(ours: dict, cfg: ModelConfig) -> dict:
    if cfg.flavour == Flavour.gpt2:
        out = {"transformer.wte.weight": ours["embed.tokens.weight"],
               "transformer.wpe.weight": ours["embed.positions.weight"],
               "transformer.ln_f.weight": ours["norm.weight"],
               "transformer.ln_f.bias": ours["norm.bias"]}
    else:
        out = {"model.embed_tokens.weight": ours["embed.tokens.weight"],
               "model.norm.weight": ours["norm.weight"]}
    if not ties_embeddings(cfg):
        out["lm_head.weight"] = ours["head.weight"]
    return out


def to_hf_parts(cfg: ModelConfig) -> Iterator[tuple[list[str], Callable[[dict], dict]]]:
    """to_hf a piece at a time (embeddings, norm and head, then each layer):
    (our keys it reads, function from those tensors to transformers'), so an
    export holds one piece in memory, not the model."""
    keys = sorted(hf_mapping(cfg))
    layer_fn = _gpt2_layer_to_hf if cfg.flavour == Flavour.gpt2 else _llama_layer_to_hf
    yield [k for k in keys if not k.startswith("layers.")], lambda ours: _top_to_hf(ours, cfg)
    for i in range(cfg.num_layers):
        yield ([k for k in keys if k.startswith(f"layers.{i}.")],
               lambda ours, i=i: layer_fn(ours, i, cfg))


def to_hf(ours: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """megaresil's full, layout-free state dict → a transformers state dict
    (contiguous tensors, as safetensors stores them). A tied head is not
    stored: transformers ties it on load."""
    out = {}
    for _, part in to_hf_parts(cfg):
        out.update(part(ours))
    return {name: t.contiguous() for name, t in out.items()}


# --- configs ----------------------------------------------------------------------


def rope_fields(m: ModelConfig) -> dict:
    """The RoPE settings the model's rope type uses: without scaling the
    scaling block's other fields (a recipe's factor 32, say) compute nothing."""
    scaling = dataclasses.asdict(m.rope_scaling)
    if m.rope_scaling.type == RopeScalingType.none:
        scaling = {"type": scaling["type"]}
    return {"rope_theta": m.rope_theta, "rope_scaling": scaling}


def architecture(m: ModelConfig) -> dict:
    """What a model computes, beyond its tensors' shapes and keys (which a
    load checks itself), with defaults resolved."""
    return {"flavour": m.flavour.value, "norm_eps": m.norm_eps, "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads or m.num_heads, **rope_fields(m),
            "tied": ties_embeddings(m), "ffn_hidden_size": ffn_size(m)}


def model_differences(saved: ModelConfig, ours: ModelConfig) -> list[str]:
    """One `key=saved (this recipe: ours)` per architecture setting that differs."""
    theirs, mine = architecture(saved), architecture(ours)
    return [f"{key}={theirs[key]} (this recipe: {mine[key]})"
            for key in theirs if theirs[key] != mine[key]]


ARCHITECTURES = {Flavour.gpt2: "GPT2LMHeadModel", Flavour.llama: "LlamaForCausalLM"}


class UnsupportedModel(CheckpointError):
    """A Hugging Face model that megaresil's model cannot represent."""


# The config.json sizes that drive what an import builds (a name map per
# layer, embeddings of vocab_size rows), each with the tensor dimension that
# shows it: (config.json key, megaresil key, tensor, dim), per flavour.
DECLARED_SIZES = {
    Flavour.gpt2: (("vocab_size", "vocab_size", "transformer.wte.weight", 0),
                   ("n_embd", "hidden_size", "transformer.wte.weight", 1),
                   ("n_positions", "max_seq_len", "transformer.wpe.weight", 0),
                   ("n_inner", "ffn_hidden_size", "transformer.h.0.mlp.c_fc.weight", 1)),
    Flavour.llama: (("vocab_size", "vocab_size", "model.embed_tokens.weight", 0),
                    ("hidden_size", "hidden_size", "model.embed_tokens.weight", 1),
                    ("intermediate_size", "ffn_hidden_size", "model.layers.0.mlp.gate_proj.weight",
                     0)),
}
LAYERS_KEY = {Flavour.gpt2: "n_layer", Flavour.llama: "num_hidden_layers"}
LAYER_INDEX = re.compile(r"^(?:transformer\.h|model\.layers)\.(\d+)\.")


def _held_layers(layers: list[int]) -> str:
    if not layers:
        return "no layers"
    span = f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
    return f"{span} ({len(layers)} in all)"


def declared_size_errors(model_keys: dict, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """What config.json declares (as config_from_hf's `model.*` keys) that
    the weights' headers contradict: the layer count against the layer
    indices present, each size in DECLARED_SIZES against its tensor. A
    tensor that is missing is the key check's to name."""
    flavour = Flavour(model_keys["flavour"])
    layers = sorted({int(found[1]) for key in shapes if (found := LAYER_INDEX.match(key))})
    errors, declared_layers = [], model_keys["num_layers"]
    # Compared without counting up to the declared number: it may be 10**15.
    if layers != list(range(len(layers))) or declared_layers != len(layers):
        errors.append(f"{LAYERS_KEY[flavour]}={model_keys['num_layers']} but the weights hold "
                      f"{_held_layers(layers)}")
    for hf_key, key, tensor, dim in DECLARED_SIZES[flavour]:
        declared, shape = model_keys.get(key), shapes.get(tensor)
        if declared is not None and shape is not None and (len(shape) <= dim
                                                           or shape[dim] != declared):
            errors.append(f"{hf_key}={declared} but {tensor} has shape {list(shape)}")
    return errors


def _gpt2_config_to_hf(cfg: ModelConfig) -> dict:
    return {"model_type": "gpt2", "n_layer": cfg.num_layers, "n_embd": cfg.hidden_size,
            "n_head": cfg.num_heads, "n_inner": ffn_size(cfg), "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.attention_dropout}


def _rope_to_hf(cfg: ModelConfig) -> dict:
    scaling = cfg.rope_scaling
    if scaling.type == RopeScalingType.none:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len}


def _llama_config_to_hf(cfg: ModelConfig) -> dict:
    rope = _rope_to_hf(cfg)
    return {"model_type": "llama", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
            "head_dim": cfg.hidden_size // cfg.num_heads, "intermediate_size": ffn_size(cfg),
            "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            # Older transformers read rope_theta and rope_scaling, newer ones rope_parameters.
            "rope_theta": cfg.rope_theta, "rope_parameters": rope,
            "rope_scaling": None if rope["rope_type"] == "default" else rope,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": cfg.attention_dropout}


def config_to_hf(cfg: ModelConfig, dtype: str, bos: Optional[int] = None,
                 eos: Optional[int] = None) -> dict:
    """The config.json of the equivalent transformers model; `bos`/`eos`
    are the token ids to declare (None leaves transformers' defaults)."""
    specific = _gpt2_config_to_hf(cfg) if cfg.flavour == Flavour.gpt2 else _llama_config_to_hf(cfg)
    tokens = {name: token for name, token in (("bos_token_id", bos), ("eos_token_id", eos))
              if token is not None}
    return {"architectures": [ARCHITECTURES[cfg.flavour]], **specific, **tokens,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": ties_embeddings(cfg),
            "initializer_range": cfg.init_std,
            "dtype": dtype, "torch_dtype": dtype}  # newer transformers read dtype, older torch_dtype


def _require_hf(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise UnsupportedModel(f"config.json {key}: {problem}; megaresil's model has no such "
                               "variant. Fix: convert a model without it.")


def _gpt2_config_from_hf(hf: dict, notes: list[str]) -> dict:
    _require_hf(hf.get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"),
                "activation_function", f"{hf.get('activation_function')!r} is not tanh-GELU")
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        _require_hf(not hf.get(flag, False), flag, "is set")
    _require_hf(hf.get("scale_attn_weights", True), "scale_attn_weights", "is off")
    resid, embd = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    if embd != resid:
        notes.append(f"config.json has embd_pdrop={embd} and resid_pdrop={resid}; megaresil has "
                     f"one model.dropout for both and uses {resid}")
    return {"flavour": "gpt2", "num_layers": hf["n_layer"], "hidden_size": hf["n_embd"],
            "num_heads": hf["n_head"], "num_kv_heads": None, "ffn_hidden_size": hf.get("n_inner"),
            "max_seq_len": hf["n_positions"], "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
            "tie_embeddings": hf.get("tie_word_embeddings", True), "dropout": resid,
            "attention_dropout": hf.get("attn_pdrop", 0.1),
            "bos_token_id": _token_id(hf, "bos_token_id", notes),
            "eos_token_id": _token_id(hf, "eos_token_id", notes)}


def _rope_from_hf(hf: dict) -> dict:
    """rope_theta and rope_scaling from either spelling: rope_parameters
    (transformers 5) or rope_theta + rope_scaling (earlier, and the files
    published for Llama 3.x)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require_hf(kind in ("default", "llama3"), "rope_parameters", f"RoPE scaling {kind!r} (only "
                "Llama 3's 'llama3' scaling is implemented)")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return {"rope_theta": theta, "rope_scaling": {"type": "none"}}
    try:
        scaling = {"type": "llama3", "factor": float(rope["factor"]),
                   "low_freq_factor": float(rope["low_freq_factor"]),
                   "high_freq_factor": float(rope["high_freq_factor"]),
                   "original_max_seq_len": int(rope["original_max_position_embeddings"])}
    except KeyError as err:
        raise UnsupportedModel(f"config.json rope_parameters: llama3 scaling without "
                               f"{err.args[0]!r}. Fix: save the config with transformers' "
                               "save_pretrained.") from None
    return {"rope_theta": theta, "rope_scaling": scaling}


def _token_id(hf: dict, key: str, notes: list[str]) -> Optional[int]:
    token = hf.get(key)
    if isinstance(token, list):  # instruction-tuned Llamas list several ends
        notes.append(f"config.json {key}={token}: megaresil keeps one id, {token[0]}")
        token = token[0] if token else None
    if token is not None and token >= hf["vocab_size"]:  # GPT2Config's default 50256 in a small vocabulary
        notes.append(f"config.json {key}={token} is outside its vocabulary "
                     f"({hf['vocab_size']}); not carried over")
        token = None
    return token


def _llama_config_from_hf(hf: dict, notes: list[str]) -> dict:
    heads = hf["num_attention_heads"]
    _require_hf(hf.get("hidden_act", "silu") == "silu", "hidden_act", f"{hf.get('hidden_act')!r}")
    for flag in ("attention_bias", "mlp_bias"):
        _require_hf(not hf.get(flag, False), flag, "is set")
    _require_hf(hf.get("head_dim") in (None, hf["hidden_size"] // heads), "head_dim",
                f"{hf.get('head_dim')} differs from hidden_size / num_attention_heads")
    return {"flavour": "llama", "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "ffn_hidden_size": hf["intermediate_size"],
            "max_seq_len": hf["max_position_embeddings"], "norm_eps": hf.get("rms_norm_eps", 1e-6),
            **_rope_from_hf(hf), "tie_embeddings": hf.get("tie_word_embeddings", False),
            # transformers' Llama has attention dropout only.
            "dropout": 0.0, "attention_dropout": hf.get("attention_dropout", 0.0),
            "bos_token_id": _token_id(hf, "bos_token_id", notes),
            "eos_token_id": _token_id(hf, "eos_token_id", notes)}


def config_from_hf(hf: dict) -> tuple[dict, list[str]]:
    """A transformers config.json → megaresil's `model.*` keys (architecture,
    dropout, init scale, token ids), and one line per setting that could not
    be carried over exactly."""
    architecture = (hf.get("architectures") or [None])[0]
    flavours = {arch: flavour for flavour, arch in ARCHITECTURES.items()}
    if architecture not in flavours:
        raise UnsupportedModel(f"config.json names architecture {architecture!r}; megaresil "
                               f"converts {sorted(flavours)}. Fix: export the model as one of "
                               "them.")
    from_hf_config = (_gpt2_config_from_hf if flavours[architecture] == Flavour.gpt2
                      else _llama_config_from_hf)
    notes: list[str] = []
    try:
        model = from_hf_config(hf, notes)
        model.update(vocab_size=hf["vocab_size"], init_std=hf.get("initializer_range", 0.02))
    except KeyError as err:
        raise UnsupportedModel(f"config.json has no {err.args[0]!r}, which {architecture} needs. "
                               "Fix: save the config with transformers' save_pretrained.") from None
    return model, notes
