"""Hugging Face's mixtures of experts, Mixtral and Qwen3-MoE, on tiny random
models: our model gives transformers' logits (fp32) from either spelling of
the experts (the Hub's one matrix per expert, transformers' in-memory
stacks); an import keeps every expert; import then export writes the very
tensors save_pretrained wrote; an export gathers every expert from a
tp2 x ep2 checkpoint; `megaresil train --from-hf` continues pre-training
at ep=2; what a family cannot hold is refused in one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.hf import io as hf_io
from megaresil.checkpoint.hf.mapping import config_from_hf, from_hf
from megaresil.checkpoint.sources import CheckpointSource
from megaresil.cli import main
from megaresil.config import ConfigError, load_recipe, model_from_dict
from megaresil.events import read_events, read_metrics
from megaresil.launch.from_hf import resolve_from_hf
from megaresil.model.gpt import GPT
from tests.harness.cli import ROOT
from tests.harness.hf import megaresil_model
from tests.harness.model import load_full_state

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SIZES = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def mixtral(**overrides):
    torch.manual_seed(0)
    config = dict(SIZES, num_hidden_layers=2, intermediate_size=32, num_local_experts=4,
                  num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**{**config, **overrides})).eval()


def qwen3_moe(**overrides):
    """Layer 0 dense (mlp_only_layers), layers 1-2 with experts, q/k norms."""
    torch.manual_seed(0)
    config = dict(SIZES, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=32,
                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                  mlp_only_layers=[0], decoder_sparse_step=1)
    model = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**{**config, **overrides})).eval()
    with torch.no_grad():  # transformers starts them at 1: make them count
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
    return model


FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def model_keys(hf) -> dict:
    keys, notes = config_from_hf(hf.config.to_dict()
                                 | {"architectures": [type(hf).__name__]})
    assert not notes
    return keys


@pytest.mark.parametrize("family,overrides", [("mixtral", {}), ("qwen3_moe", {}),
                                              ("qwen3_moe", {"norm_topk_prob": False})])
def test_logits_equal_transformers_from_its_in_memory_stacks(family, overrides):
    hf = FAMILIES[family](**overrides)
    cfg = model_from_dict(model_keys(hf))
    assert cfg.flavour.value == family and cfg.moe.num_experts == 4
    assert cfg.moe.normalize_top_k == overrides.get("norm_topk_prob", True)
    assert any(key.endswith("experts.gate_up_proj") for key in hf.state_dict())
    ours = GPT(cfg).eval()
    load_full_state(ours, cfg, from_hf(hf.state_dict(), cfg))
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(ours.logits(tokens), hf(tokens).logits) <= 1e-5


def hub_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(directory / "model.safetensors")


def import_at_tp2_then_export(hf, tmp_path: Path) -> None:
    """Save `hf` to tmp_path/hf, import it at tp=2 to tmp_path/ckpt (whose
    logits must be transformers'), export that to tmp_path/out, and check
    the export holds the very tensors save_pretrained wrote."""
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                 "--tp", "2"]) == 0
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(megaresil_model(tmp_path / "ckpt").logits(tokens),
                              hf(tokens).logits) <= 1e-5
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")]) == 0
    saved, exported = hub_tensors(tmp_path / "hf"), hub_tensors(tmp_path / "out")
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[key], saved[key]) for key in saved)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_keeps_every_expert_and_export_writes_what_save_pretrained_wrote(family,
                                                                                 tmp_path):
    hf = FAMILIES[family]()
    hf.save_pretrained(tmp_path / "hf")
    saved = hub_tensors(tmp_path / "hf")
    per_expert = [key for key in saved if ".experts." in key]
    layers = 2  # of experts: qwen3_moe has a dense layer 0 besides
    assert len(per_expert) == layers * 4 * 3  # the Hub's spelling: one matrix per expert

    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    source = CheckpointSource(tmp_path / "ckpt")
    stacks = {key: info["global_shape"] for key, info in source.tensors.items()
              if ".mlp.experts." in key}
    assert len(stacks) == layers * 3 and all(shape[0] == 4 for shape in stacks.values())
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(megaresil_model(tmp_path / "ckpt").logits(tokens),
                              hf(tokens).logits) <= 1e-5

    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")]) == 0
    exported = hub_tensors(tmp_path / "out")
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[key], saved[key]) for key in saved)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, hf(tokens).logits)


def test_export_gathers_every_expert_from_a_tp2_ep2_checkpoint(tmp_path):
    hf = qwen3_moe()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                 "--tp", "2", "--dp", "2", "--set", "parallel.ep=2"]) == 0
    layout = json.loads((tmp_path / "ckpt" / fmt.MANIFEST).read_text())["layout"]
    assert (layout["tp"], layout["ep"]) == (2, 2)
    assert main(["convert", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "out")]) == 0
    saved, exported = hub_tensors(tmp_path / "hf"), hub_tensors(tmp_path / "out")
    assert sorted(exported) == sorted(saved)
    assert all(torch.equal(exported[key], saved[key]) for key in saved)


def test_a_file_in_the_stacked_spelling_imports_too(tmp_path):
    hf = mixtral()
    hf.save_pretrained(tmp_path / "hf")
    safetensors_torch.save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
                                tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(megaresil_model(tmp_path / "ckpt").logits(tokens),
                              hf(tokens).logits) <= 1e-5


def test_a_missing_expert_is_refused(tmp_path):
    mixtral().save_pretrained(tmp_path / "hf")
    weights = hub_tensors(tmp_path / "hf")
    del weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    safetensors_torch.save_file(weights, tmp_path / "hf" / "model.safetensors",
                                metadata={"format": "pt"})
    with pytest.raises(fmt.CheckpointError, match="lacks 1 tensor.s. .model.layers.1."
                                                  "block_sparse_moe.experts.3.w2.weight"):
        hf_io.hf_source(tmp_path / "hf", model_from_dict(hf_io.hf_model_keys(
            tmp_path / "hf")[0]))


def test_what_transformers_cannot_hold_is_refused_in_one_line(tmp_path):
    mixtral().save_pretrained(tmp_path / "hf")
    with pytest.raises(ConfigError, match="model.moe: --from-hf of a mixture of experts is not "
                                          "supported yet for flavour mixtral: .*a shared expert"):
        resolve_from_hf(tmp_path / "hf", str(ROOT / "recipes" / "moe-tiny.yaml"),
                        ["model.moe.shared_expert_hidden_size=32"])


@pytest.mark.slow
def test_from_hf_continues_pretraining_at_ep2_and_exports(cli, cli_main, tmp_path):
    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    hf = mixtral()
    hf.save_pretrained(hf_dir)
    result = cli("train", "recipes/moe-tiny.yaml", "--from-hf", str(hf_dir), f"run.dir={run}",
                 "data.source=synthetic", "data.path=null", "data.seq_len=32", "parallel.tp=1",
                 "parallel.pp=1", "parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=2",
                 "train.global_batch_size=4", "train.steps=3", "train.eval_batches=0",
                 "optimizer.warmup_steps=1", "checkpoint.interval=3",
                 "logging.progress=false", "logging.tensorboard=false")
    assert "model.moe.num_experts             8 -> 4" in result.stderr  # moe-tiny's, replaced
    (started,) = [e for e in read_events(run) if e["event"] == "initialized_from"]
    assert started["source"] == "hugging_face" and started["layout"]["ep"] == 2
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    checkpoint = run / "checkpoints" / fmt.step_dir_name(3)

    cli_main("convert", str(checkpoint), "--to-hf", str(out))
    trained = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    exported = hub_tensors(out)
    assert sorted(exported) == sorted(hub_tensors(hf_dir))
    moved = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    assert not torch.equal(exported[moved],  # trained: every expert saw tokens
                           hf.state_dict()["model.layers.1.mlp.experts.down_proj"][3])
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(trained(tokens).logits,
                              megaresil_model(checkpoint).logits(tokens)) <= 1e-5


@pytest.mark.parametrize("flavour", sorted(FAMILIES))
def test_a_family_of_experts_needs_experts(flavour):
    with pytest.raises(ConfigError, match=f"model.moe.num_experts: the {flavour} flavour is a "
                                          "mixture of experts"):
        load_recipe(ROOT / "recipes" / "gpt-tiny.yaml", [f"model.flavour={flavour}"])
