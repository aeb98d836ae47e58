"""Our model against Hugging Face transformers' reference implementations:
same config and weights (random init, no download) must give the same logits."""
import pytest
import torch

from megaresil.checkpoint.hf import from_hf
from megaresil.config import Flavour, ModelConfig
from megaresil.model.gpt import GPT
from megaresil.model.init import load_full_state

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
