"""Megatron-LM checkpoints out (`megaresil convert SRC --to-megatron DIR`),
against Megatron-Core itself: a random megaresil model saved at tp=2 and
exported loads with Mcore's own `dist_checkpointing.load` into its GPTModel
at tp=1 and tp=2 with megaresil's logits (gpt2, llama, llama with experts
and a shared expert, with an expert bias, mistral, mixtral, qwen2, qwen3, qwen3-moe), under
exactly the
keys and shapes Mcore's own save writes; the files beside the tensors are
what Mcore and Megatron-LM read (metadata.json, the common state twice, the
args, the tracker); what Mcore's GPT cannot hold is refused in one line."""
from __future__ import annotations

import argparse
import io
import json
import re
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megaresil.checkpoint.hf.mapping import model_differences
from megaresil.checkpoint.megatron import writing
from megaresil.checkpoint.megatron.writing import export_to_megatron, refusals
from megaresil.checkpoint.offline.planning import planned_rects, recipe_layout
from megaresil.checkpoint.offline.writer import write_checkpoint
from megaresil.checkpoint.state import RunRecord
from megaresil.cli import main
from megaresil.config import Flavour, RecipeConfig, from_dict, load_recipe, to_dict
from megaresil.config.flavours import MEGATRON
from megaresil.ports import free_port
from tests.harness import mcore
from tests.harness.cli import ROOT
from tests.harness.hf import megaresil_model

pytestmark = pytest.mark.skipif(mcore.missing_reason() is not None,
                                reason=str(mcore.missing_reason()))

STEP, CONSUMED = 5, 40
SAVED_AT = ["parallel.tp=2", "parallel.pp=1", "parallel.dp=1", "train.micro_batch_size=2",
            "train.global_batch_size=4"]
LOADED_AT = (1, 2)  # Mcore's tensor-parallel sizes that load each export


def recipe(flavour: str, *overrides: str) -> RecipeConfig:
    return load_recipe(mcore.RECIPE, mcore.TINY + mcore.FLAVOURS[flavour] + SAVED_AT
                       + list(overrides))


class RandomWeights:
    """A TensorSource of the weights of `cfg`'s model, random (seeded by
    key): norms near one, the rest small."""

    def __init__(self, cfg: RecipeConfig):
        self.full = {r.key: self._draw(r.key, r.global_shape)
                     for r in planned_rects(cfg, weights_only=True)[0]}  # whole tensors at tp=1
        self.tensors = {key: {"global_shape": list(t.shape), "dtype": "float32"}
                        for key, t in self.full.items()}

    @staticmethod
    def _draw(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
        return 1 + 0.1 * noise if "norm" in key else 0.2 * noise

    def read(self, targets) -> None:
        for target in targets:
            region = tuple(slice(o, o + n) for o, n in zip(target.offset, target.shape))
            target.tensor.copy_(self.full[target.key][region])


def random_checkpoint(flavour: str, dst: Path) -> Path:
    """A weights-only checkpoint of random weights, saved at tp=2."""
    cfg = recipe(flavour)
    state = RunRecord(step=STEP, layout=recipe_layout(cfg), recipe=to_dict(cfg),
                      consumed_samples=CONSUMED, optimizer_steps=STEP, weights_only=True)
    return write_checkpoint(RandomWeights(recipe(flavour, "parallel.tp=1")), cfg, dst,
                            backend="torch_dist", weights_only=True, state=state, overwrite=False)


# --- Megatron-Core's side, in spawned ranks ----------------------------------------


def _load_one(flavour: str, tp: int, export: Path, out: Path) -> None:
    """Mcore's GPTModel at tp (Megatron's vocabulary padding at tp) loaded
    from the export with dist_checkpointing.load; its logits, and the keys
    and global shapes its own sharded_state_dict asks for."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tp, 1)
    try:
        cfg = mcore.Saved(flavour).recipe()
        model = mcore.build_model(cfg, torch.device("cpu"), mcore.megatron_padded_vocab(cfg, tp))
        iteration = export / f"iter_{int((export / writing.TRACKER).read_text()):07d}"
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(iteration))
        model.load_state_dict(loaded["model"])
        logits = mcore.stage_logits(model, cfg, mcore.fixed_tokens(cfg))
        if logits is not None:
            torch.save(logits[..., :cfg.model.vocab_size], out / f"{flavour}-tp{tp}.pt")
            (out / f"{flavour}-tp{tp}.json").write_text(json.dumps(_asked(model)))
        torch.distributed.barrier()
    finally:
        ps.destroy_model_parallel()


def _asked(model) -> dict:
    """What Mcore's load of the model reads: each tensor's key and global
    shape, each object's key (a null shape)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories

    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    return {v.unique_key if isinstance(v, ShardedObject) else v.key:
            None if isinstance(v, ShardedObject) else list(v.global_shape)
            for v in nested_values(sharded)}


def _worker(rank: int, world: int, port: int, exports: dict[str, str], out: str) -> None:
    from tests.harness.dist import join_group

    join_group(rank, world, port)
    mcore.cpu_shim()
    try:
        for flavour, export in exports.items():
            for tp in LOADED_AT:
                _load_one(flavour, tp, Path(export), Path(out))
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """Per flavour: the megaresil checkpoint, its export, megaresil's logits
    and Mcore's (per tp), loaded in one spawned 2-rank group."""
    from tests.harness.dist import spawn_ranks

    root = tmp_path_factory.mktemp("megatron-export")
    cases = {}
    for flavour in mcore.FLAVOURS:
        cfg = recipe(flavour)
        checkpoint = random_checkpoint(flavour, root / flavour / "ckpt")
        export = export_to_megatron(checkpoint, root / flavour / "megatron")
        ours = megaresil_model(checkpoint).logits(mcore.fixed_tokens(cfg))
        cases[flavour] = {"checkpoint": checkpoint, "export": export, "ours": ours}
    spawn_ranks(_worker, (mcore.WORLD, free_port(), {f: str(c["export"]) for f, c in cases.items()},
                          str(root)), mcore.WORLD)
    for flavour, case in cases.items():
        case["mcore"] = {tp: torch.load(root / f"{flavour}-tp{tp}.pt") for tp in LOADED_AT}
        case["asked"] = {tp: json.loads((root / f"{flavour}-tp{tp}.json").read_text())
                         for tp in LOADED_AT}
    return cases


@pytest.mark.parametrize("tp", LOADED_AT)
@pytest.mark.parametrize("flavour", sorted(mcore.FLAVOURS))
def test_mcore_loads_the_export_with_megaresils_logits(exported, flavour, tp):
    case = exported[flavour]
    theirs, ours = case["mcore"][tp], case["ours"]
    assert theirs.shape == ours.shape
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def _saved(iteration: Path) -> dict:
    return dcp.FileSystemReader(str(iteration)).read_metadata().state_dict_metadata


@pytest.mark.parametrize("flavour", sorted(mcore.FLAVOURS))
def test_the_export_holds_the_keys_and_shapes_mcore_asks_for(exported, flavour):
    iteration = exported[flavour]["export"] / f"iter_{STEP:07d}"
    saved = {key: list(entry.size) if hasattr(entry, "size") else None
             for key, entry in _saved(iteration).items()}
    asked = exported[flavour]["asked"][1]
    vocab_rows = {"embedding.word_embeddings.weight", "output_layer.weight"}
    assert {k: v for k, v in saved.items() if v is not None and k not in vocab_rows} == \
        {k: v for k, v in asked.items() if v is not None and k not in vocab_rows}
    # Every object it asks for; beside them Transformer Engine's attention's
    # extra states and the common state, which this load does not ask for.
    objects = {k for k, v in saved.items() if v is None} - {k for k, v in asked.items() if v is None}
    assert {re.sub(r"^decoder\.layers\.\d+\.", "decoder.layers.", k.split("/")[0])
            for k in objects} == {"decoder.layers.self_attention.core_attention._extra_state",
                                  "common_state"}
    cfg = recipe(flavour).model
    for key in vocab_rows & set(saved):  # Megatron's padding at tp=1
        assert saved[key] == [384, cfg.hidden_size] == asked[key]


def _common_state_in_dcp(iteration: Path) -> dict:
    """The common state as later Mcores read it: the DCP object, unpickled
    with weights_only (Namespace allowed, as Mcore registers it)."""
    raw = {writing.COMMON_STATE: io.BytesIO()}
    dcp.load(raw, storage_reader=dcp.FileSystemReader(str(iteration)), no_dist=True)
    value = raw[writing.COMMON_STATE]
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, weights_only=True)
    return value[0]


def test_the_files_beside_the_tensors_are_what_megatron_reads(exported):
    export = exported["llama"]["export"]
    assert (export / writing.TRACKER).read_text() == str(STEP)
    iteration = export / f"iter_{STEP:07d}"
    assert json.loads((iteration / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1,
        "common_backend": "torch", "common_backend_version": 1}
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(iteration / writing.COMMON, weights_only=True)
        assert _common_state_in_dcp(iteration) == common
    assert common["iteration"] == STEP and common["checkpoint_version"] == 3.0
    args, m = common["args"], recipe("llama").model
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups,
            args.kv_channels, args.ffn_hidden_size) == (2, 64, 4, 2, 16, 96)
    assert args.group_query_attention and args.swiglu and args.untie_embeddings_and_output_weights
    assert (args.normalization, args.position_embedding_type, args.rotary_base) == \
        ("RMSNorm", "rope", 10000)
    assert not args.add_bias_linear and args.padded_vocab_size == 384
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert args.iteration == STEP and args.consumed_train_samples == CONSUMED
    assert args.no_save_optim and args.no_save_rng and args.ckpt_format == "torch_dist"
    assert args.norm_epsilon == m.norm_eps
    assert args.num_experts is None
    moe = torch.load(exported["moe"]["export"] / f"iter_{STEP:07d}" / writing.COMMON,
                     weights_only=False)["args"]
    assert (moe.num_experts, moe.moe_router_topk, moe.moe_layer_freq,
            moe.moe_shared_expert_intermediate_size, moe.moe_router_pre_softmax) == \
        (4, 2, [0, 1], 32, False)
    gpt2 = torch.load(exported["gpt2"]["export"] / f"iter_{STEP:07d}" / writing.COMMON,
                      weights_only=False)["args"]
    assert (gpt2.normalization, gpt2.position_embedding_type, gpt2.add_bias_linear,
            gpt2.openai_gelu, gpt2.untie_embeddings_and_output_weights, gpt2.swiglu) == \
        ("LayerNorm", "learned_absolute", True, True, False, False)


def test_what_mcores_gpt_cannot_hold_is_refused(monkeypatch):
    assert [refusals(recipe(flavour).model) for flavour in sorted(mcore.FLAVOURS)] == \
        [[]] * len(mcore.FLAVOURS)
    windowed = recipe("qwen2", "model.sliding_window=8").model
    assert refusals(windowed) == ["model.sliding_window=8 (not exported yet: Megatron's "
                                  "window_size needs its flash attention)"]
    monkeypatch.delitem(MEGATRON, Flavour.mixtral)  # a flavour Mcore's GPT would not compute
    mixtral = load_recipe(ROOT / "recipes" / "mixtral-8x7b.yaml").model
    assert refusals(mixtral)[0].startswith("flavour mixtral (the export converts gpt2, llama,")
    bias = recipe("moe", "model.moe.bias_update_rate=0.001").model  # softmax scores
    assert refusals(bias) == ["an expert bias over softmax scores (Megatron's expert bias takes "
                              "model.moe.score_function=sigmoid only)"]
    odd = recipe("llama", "model.rope_theta=10000.5", "model.rope_scaling.type=llama3",
                 "model.rope_scaling.original_max_seq_len=64").model
    assert [r.split(" ")[0] for r in refusals(odd)] == ["model.rope_theta=10000.5",
                                                        "model.rope_scaling"]


def _tensors(iteration: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, read back whole with plain DCP."""
    shapes = {key: entry for key, entry in _saved(iteration).items() if hasattr(entry, "size")}
    out = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
           for key, entry in shapes.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(iteration)), no_dist=True)
    return out


@pytest.mark.parametrize("flavour", sorted(mcore.FLAVOURS))
def test_megaresil_to_megatron_and_back_is_bit_identical(exported, flavour, cli_main, tmp_path):
    case = exported[flavour]
    back = tmp_path / "back"
    cli_main("convert", "--from-megatron", str(case["export"]), str(back), "--tp", "2",
             "--pp", "1", "--dp", "1")
    diff = cli_main("ckpt", "diff", str(case["checkpoint"]), str(back))  # exit 0: identical
    assert re.fullmatch(r"(\d+) common tensors, \1 identical, 0 not identical, 0 only in A, "
                        r"0 only in B", diff.stdout.strip())
    manifests = [json.loads((c / "metadata.json").read_text()) for c in (case["checkpoint"], back)]
    assert [m["step"] for m in manifests] == [STEP, STEP]
    original, returned = (from_dict(m["recipe"]).model for m in manifests)
    # Megatron's args cannot tell Mistral (no window) from Llama, which computes the same.
    assert model_differences(original, returned) == (
        ["flavour=mistral (this recipe: llama)"] if flavour == "mistral" else [])


@pytest.mark.journey
def test_the_installed_command_exports_bfloat16(exported, tmp_path):
    from tests.harness.journey import megaresil

    fp32 = exported["llama"]["export"]
    result = megaresil("convert", str(exported["llama"]["checkpoint"]), "--to-megatron",
                       str(tmp_path / "bf16"), "--dtype", "bfloat16", cwd=tmp_path)
    assert result.stdout.strip() == f"wrote {tmp_path / 'bf16'}"
    assert "NullTokenizer" in result.stderr  # synthetic data: no tokenizer to name
    iteration = f"iter_{STEP:07d}"
    ours, reference = _tensors(tmp_path / "bf16" / iteration), _tensors(fp32 / iteration)
    assert ours.keys() == reference.keys()
    for key, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[key].bfloat16())
    args = torch.load(tmp_path / "bf16" / iteration / writing.COMMON, weights_only=False)["args"]
    assert args.bf16 and not args.fp16 and args.params_dtype == torch.bfloat16


@pytest.mark.parametrize("argv, message", [
    (["SRC", "--to-megatron", "OUT", "--tp", "2"],
     "--to-megatron exports the weights alone at tp=1, pp=1"),
    (["SRC", "--to-megatron", "OUT", "--tokenizer", "gpt2"],
     "--tokenizer applies to --to-hf and --from-megatron"),
    (["SRC", "--to-megatron", "OUT", "--to-hf", "HF"], "give one of --to-hf, --from-hf"),
    (["SRC", "DST", "--to-megatron", "OUT"], "expected convert SRC --to-megatron DIR; got 2 path(s)")])
def test_convert_refuses_options_that_do_not_apply(capsys, argv, message):
    with pytest.raises(SystemExit):
        main(["convert", *argv])
    assert message in capsys.readouterr().err
