"""Hugging Face's dense families beyond Llama, on tiny random models: Qwen2
(q/k/v biases, tied or not), dense Qwen3 (q/k norms, heads 24 wide in a
64-wide model) and Mistral (a sliding window of 5 over 32 tokens, or none).
Our model gives transformers' logits (fp32); an import at tp=2 does too;
import then export writes the very tensors save_pretrained wrote and a
config.json that reads back to the same model; greedy generation keeps to
the window as transformers' cached generate does; `train --from-hf`
continues pre-training at tp=2 and exports what transformers loads; what
the model cannot hold is refused in one line."""
from __future__ import annotations

import json

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.hf.mapping import UnsupportedModel, config_from_hf, from_hf
from megaresil.config import ConfigError, load_recipe, model_from_dict
from megaresil.events import read_events
from megaresil.generation import Sampling, continue_batch
from megaresil.model.gpt import GPT
from tests.harness.cli import ROOT
from tests.harness.hf import megaresil_model
from tests.harness.model import load_full_state
from tests.unit.test_checkpoint_hf_moe import (
    SIZES,
    hub_tensors,
    import_at_tp2_then_export,
    model_keys,
    relative_error,
)

transformers = pytest.importorskip("transformers")

WINDOW = 5  # tokens a query sees, its own included; the tests' sequences are 32 long
DENSE = {**SIZES, "num_hidden_layers": 2, "intermediate_size": 96, "bos_token_id": 1,
         "eos_token_id": 2}


def _randomized(model, suffixes: tuple[str, ...]):
    """transformers starts biases at 0 and norms at 1: make them count."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffixes):
                param.uniform_(0.5, 1.5)
    return model.eval()


def qwen2(**overrides):
    torch.manual_seed(0)
    config = {**DENSE, **overrides}
    return _randomized(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config)),
                       ("_proj.bias",))


def qwen3(**overrides):
    torch.manual_seed(0)
    config = {**DENSE, "head_dim": 24, **overrides}
    return _randomized(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)),
                       ("q_norm.weight", "k_norm.weight"))


def mistral(**overrides):
    torch.manual_seed(0)
    config = {**DENSE, "sliding_window": WINDOW, **overrides}
    return transformers.MistralForCausalLM(transformers.MistralConfig(**config)).eval()


# (case, model, the model.* keys it must import as)
CASES = {
    "qwen2": (lambda: qwen2(), {"flavour": "qwen2", "sliding_window": None}),
    "qwen2_tied_window": (lambda: qwen2(tie_word_embeddings=True, use_sliding_window=True,
                                        sliding_window=WINDOW, max_window_layers=0),
                          {"flavour": "qwen2", "sliding_window": WINDOW, "tie_embeddings": True}),
    "qwen3": (lambda: qwen3(), {"flavour": "qwen3", "head_dim": 24}),
    "mistral": (lambda: mistral(), {"flavour": "mistral", "sliding_window": WINDOW}),
    "mistral_full": (lambda: mistral(sliding_window=None),
                     {"flavour": "mistral", "sliding_window": None}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_transformers(case):
    make, expected = CASES[case]
    hf = make()
    keys = model_keys(hf)
    assert {key: keys[key] for key in expected} == expected
    cfg = model_from_dict(keys)
    ours = GPT(cfg).eval()
    load_full_state(ours, cfg, from_hf(hf.state_dict(), cfg))
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(ours.logits(tokens), hf(tokens).logits) <= 1e-5


@pytest.mark.parametrize("case", ["qwen2_tied_window", "qwen3", "mistral"])
def test_import_at_tp2_then_export_writes_the_same_tensors_and_config(case, tmp_path):
    hf = CASES[case][0]()
    import_at_tp2_then_export(hf, tmp_path)
    configs = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "out")]
    assert config_from_hf(configs[1]) == config_from_hf(configs[0])
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, hf(tokens).logits)


@pytest.mark.parametrize("case", ["mistral", "qwen2_tied_window"])
def test_greedy_generation_keeps_to_the_window_as_transformers_does(case):
    """Past the window: 12 prompt tokens, 8 new; transformers generates with
    its sliding-window KV cache, megaresil generate its own KV cache under the window."""
    hf = CASES[case][0]()
    cfg = model_from_dict(model_keys(hf))
    ours = GPT(cfg).eval()
    load_full_state(ours, cfg, from_hf(hf.state_dict(), cfg))
    prompt = torch.randint(0, 300, (1, 12))
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8,
                         do_sample=False, pad_token_id=0)[0, 12:].tolist()
    assert continue_batch(ours, [prompt[0].tolist()], cfg.max_seq_len, 8,
                          Sampling())[0] == theirs


def test_a_window_in_some_layers_only_is_refused():
    config = qwen2(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1).config
    with pytest.raises(UnsupportedModel, match=r"config.json layer_types: a sliding window in "
                                               r"layers \[1\] only"):
        config_from_hf(config.to_dict() | {"architectures": ["Qwen2ForCausalLM"]})


@pytest.mark.parametrize("override,needle", [
    ("model.flavour=llama", "model.sliding_window: the llama flavour has no sliding-window "
                            "attention.*Fix: set model.flavour=qwen2 or flavour=qwen3 or "
                            "flavour=mistral"),
    ("model.backend=te", "model.sliding_window: the Transformer Engine backend's attention is "
                         "not given the window yet.*Fix: set model.backend=local"),
])
def test_a_window_where_it_cannot_work_is_refused_in_one_line(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_recipe(ROOT / "recipes" / "gpt-tiny.yaml",
                    ["model.flavour=mistral", "model.sliding_window=64", override])


@pytest.mark.slow
def test_from_hf_trains_at_tp2_and_exports(cli, cli_main, tmp_path):
    """`megaresil train --from-hf` of a Qwen2 with a window (its biases split
    over tp=2, its mask over each rank's heads), then export: transformers
    loads the trained weights and computes our logits."""
    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    hf = CASES["qwen2_tied_window"][0]()
    hf.save_pretrained(hf_dir)
    cli("train", "recipes/gpt-tiny.yaml", "--from-hf", str(hf_dir), f"run.dir={run}",
        "data.source=synthetic", "data.seq_len=32", "parallel.tp=2", "parallel.pp=1",
        "parallel.dp=1", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.steps=2", "train.eval_batches=0", "optimizer.warmup_steps=1",
        "checkpoint.interval=2", "logging.progress=false", "logging.tensorboard=false")
    (started,) = [e for e in read_events(run) if e["event"] == "initialized_from"]
    assert started["source"] == "hugging_face" and started["layout"]["tp"] == 2
    checkpoint = run / "checkpoints" / fmt.step_dir_name(2)
    cli_main("convert", str(checkpoint), "--to-hf", str(out))
    trained = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert trained.config.sliding_window == WINDOW
    bias = "model.layers.1.self_attn.k_proj.bias"
    assert not torch.equal(hub_tensors(out)[bias], hf.state_dict()[bias])  # trained
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        assert relative_error(trained(tokens).logits,
                              megaresil_model(checkpoint).logits(tokens)) <= 1e-5
