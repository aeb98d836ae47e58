"""Our model against Hugging Face transformers' reference implementations:
same config and weights (random init, no download) must give the same logits,
in one process and at tp=2 x pp=2 (the weights loaded as a run's init_from)."""
import pytest
import torch

from tests.harness.dist import spawn_ranks
from tests.harness.hf import llama32_style, parallel_logits
from megaresil.checkpoint.hf.mapping import config_from_hf, from_hf
from megaresil.config import Flavour, ModelConfig, model_from_dict
from megaresil.ports import free_port
from megaresil.model.gpt import GPT
from tests.harness.model import load_full_state

transformers = pytest.importorskip("transformers")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def ours_from(hf_model, cfg: ModelConfig) -> GPT:
    model = GPT(cfg).eval()
    load_full_state(model, cfg, from_hf(hf_model.state_dict(), cfg))
    return model


def test_gpt2_matches_gpt2lmheadmodel():
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(vocab_size=300, n_positions=32, n_embd=64, n_layer=3,
                                     n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    cfg = ModelConfig(flavour=Flavour.gpt2, num_layers=3, hidden_size=64, num_heads=4,
                      vocab_size=300, max_seq_len=32, norm_eps=hf_cfg.layer_norm_epsilon)
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours_from(hf, cfg).logits(tokens)
    assert got.shape == expected.shape
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_llama_matches_llamaforcausallm(kv_heads):
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=kv_heads, max_position_embeddings=32,
                                      rms_norm_eps=1e-5, rope_theta=10000.0,
                                      tie_word_embeddings=False, attention_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    cfg = ModelConfig(flavour=Flavour.llama, num_layers=2, hidden_size=64, num_heads=4,
                      num_kv_heads=kv_heads, ffn_hidden_size=160, vocab_size=300,
                      max_seq_len=32, norm_eps=1e-5, rope_theta=10000.0)
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours_from(hf, cfg).logits(tokens)
    assert relative_error(got, expected) <= 1e-5


def test_llama32_style_with_rope_scaling_and_tied_embeddings_matches():
    hf = llama32_style()
    keys, notes = config_from_hf(hf.config.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    cfg = model_from_dict(keys)
    assert cfg.rope_scaling.type.value == "llama3" and cfg.tie_embeddings and not notes
    tokens = torch.randint(0, 300, (2, 128))  # past the original context: all bands matter
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours_from(hf, cfg).logits(tokens)
        unscaled = ours_from(hf, model_from_dict({**keys, "rope_scaling": {"type": "none"}}))
        assert relative_error(unscaled.logits(tokens), expected) > 1e-3  # scaling is exercised
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.slow
def test_llama32_style_matches_at_tp2_pp2_when_started_from_the_hf_directory(tmp_path):
    hf = llama32_style()
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 300, (2, 128))
    torch.save(tokens, tmp_path / "tokens.pt")
    spawn_ranks(parallel_logits, (4, free_port(), str(tmp_path / "hf"), str(tmp_path)), 4)
    with torch.no_grad():
        expected = hf(tokens).logits
    assert relative_error(torch.load(tmp_path / "logits.pt"), expected) <= 1e-5
