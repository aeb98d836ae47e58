"""Every TP/PP/DP/EP/CP layout, sharded data parallelism (FSDP2) included,
reproduces the single-process run: losses within 1e-5 relative per step over 10 steps (fp32), and the same gradients after a step.
Layouts with activation recomputation, partitioned or offloaded checkpoints
are held to the reference without recomputation."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.harness.dist import LLAMA, MOE, Case, load_grads, run_cases, run_reference
from megaresil.data.indexed import IndexedDatasetWriter
from megaresil.data.tokenizer import ByteTokenizer
from megaresil.events import read_metrics

DROPOUT = ["model.dropout=0.1", "model.attention_dropout=0.1"]
# Documents of 1 to 12 bytes, so each 16-token window holds several; the
# fixture writes them and puts their prefix in place of CORPUS.
CORPUS = "CORPUS"
DOCUMENTS = ["data.source=indexed", f"data.path={CORPUS}", "data.tokenizer=byte",
             "data.reset_position_ids=true", "data.reset_attention_mask=true",
             "data.eod_mask_loss=true", "train.eval_batches=1"]  # eval masks alike
LONG = ["data.seq_len=1024", "model.max_seq_len=1024", "train.micro_batch_size=1",
        "train.global_batch_size=4"]
# Model variants; each has its own single-process reference run.
VARIANTS = {
    "gpt2": [],
    "llama": LLAMA,
    "gpt2_dropout": DROPOUT,
    "gpt2_untied": ["model.tie_embeddings=false"],
    "llama_tied": LLAMA + ["model.tie_embeddings=true"],
    "llama_moe": MOE,
    "qwen3_moe": MOE + ["model.flavour=qwen3_moe"],  # q/k norms over each rank's heads
    # Heads 12 wide in a 64-wide model (8 heads): q is 96 wide, as Qwen3's 128 at hidden 2048.
    "qwen3_moe_head_dim": MOE + ["model.flavour=qwen3_moe", "model.head_dim=12"],
    # q/k/v biases split over tp; a window of 5 of the 16 positions (the mask
    # over the whole sequence, which SP gathers before attention).
    "qwen2_window": LLAMA + ["model.flavour=qwen2", "model.sliding_window=5"],
    # Learned positions reset per document, then cut along the sequence under SP.
    "gpt2_documents": DOCUMENTS,
    # Long sequences for context parallelism: 1024 tokens (chunks of 128 at
    # cp=4), four per step. GQA; then hidden dropout, whose masks each cp
    # rank draws for its own chunks of the whole sequence's.
    "llama_long": LLAMA + LONG,
    "gpt2_long_dropout": LONG + ["model.dropout=0.1"],
}
TP = ["parallel.tp=2"]
SP = ["parallel.sequence_parallel=true"]
DISTOPT = ["optimizer.distributed=true"]
THREE_D = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]
EP2, EP4 = ["parallel.ep=2"], ["parallel.ep=4"]
FP32 = ["train.precision=fp32"]  # ep = dp with ZeRO-1 refuses bf16, so auto too
FULL = ["model.recompute=full"]
PARTITION = FULL + ["model.activation_partition=true"]
OFFLOAD = ["model.activation_offload=cpu"]
CP2, CP4, P2P = ["parallel.cp=2"], ["parallel.cp=4"], ["parallel.cp_comm_type=p2p"]
SHARD2 = ["parallel.dp_shard=2"]  # FSDP2: full sharding at dp=2, HSDP at dp=4

# The module's fixture trains every case below once (~90 runs, ~10 minutes on
# two quiet cores), and pytest-timeout counts it in the first test's setup:
# the project's 600 s per test would cut it short, not catch a hang.
pytestmark = pytest.mark.timeout(1800)

# (layout name, overrides, variants), grouped by world size.
LAYOUTS = {
    2: [("tp2", TP, ["gpt2", "llama"]),
        ("dp2", ["parallel.dp=2"], ["gpt2", "llama"]),
        ("tp2_sp", TP + SP, ["gpt2", "llama", "gpt2_dropout", "llama_moe", "qwen3_moe",
                             "qwen3_moe_head_dim", "qwen2_window"]),
        ("dp2_distopt", ["parallel.dp=2"] + DISTOPT, ["gpt2", "llama", "llama_moe"]),
        ("dp2", ["parallel.dp=2"], ["gpt2_dropout"]),
        ("pp2_1f1b", ["parallel.pp=2"], ["gpt2", "llama", "gpt2_dropout"]),
        ("pp2_gpipe", ["parallel.pp=2", "parallel.schedule=gpipe"], ["gpt2", "llama"]),
        ("pp2_vpp2", ["parallel.pp=2", "parallel.vpp=2"],
         ["gpt2", "llama", "gpt2_dropout", "llama_moe"]),
        ("pp2_vpp2_zero_bubble", ["parallel.pp=2", "parallel.vpp=2",
                                  "parallel.schedule=interleaved_zero_bubble"], ["gpt2"]),
        ("tp2_partition_offload", TP + PARTITION + OFFLOAD, ["gpt2_dropout"]),
        ("pp2_block1_offload", ["parallel.pp=2"] + FULL + OFFLOAD +
         ["model.recompute_policy=block", "model.recompute_layers=1"], ["gpt2_dropout"]),
        ("pp2_vpp2_zero_bubble_full_offload", ["parallel.pp=2", "parallel.vpp=2",
                                               "parallel.schedule=interleaved_zero_bubble"]
         + FULL + OFFLOAD, ["gpt2_dropout"]),
        # Documents and windows across chunks (chunks of 4), experts' routing
        # losses and counts over the cp ranks.
        ("cp2", CP2, ["llama_long", "gpt2_long_dropout", "gpt2_documents", "llama_moe"]),
        ("cp2_p2p", CP2 + P2P, ["llama_long", "qwen2_window"]),
        ("dp2_fsdp", ["parallel.dp=2"] + SHARD2, ["gpt2", "llama"])],
    4: [("tp4", ["parallel.tp=4"], ["gpt2", "llama"]),
        ("dp4", ["parallel.dp=4"], ["gpt2", "llama"]),
        ("tp2_dp2", TP + ["parallel.dp=2"], ["gpt2", "llama"]),
        ("pp4_1f1b", ["parallel.pp=4"], ["gpt2", "llama"]),
        ("dp4_ep4_distopt", ["parallel.dp=4"] + EP4 + DISTOPT + FP32, ["llama_moe"]),
        ("tp2_dp2_ep2_sp", TP + SP + ["parallel.dp=2"] + EP2, ["llama_moe"]),
        ("pp2_vpp2_dp2_ep2_distopt", ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2"]
         + EP2 + DISTOPT + FP32, ["llama_moe"]),
        ("cp4_p2p", CP4 + P2P, ["llama_long"]),
        ("tp2_cp2_sp", TP + CP2 + SP, ["llama_long", "gpt2_long_dropout"]),
        ("cp2_dp2_distopt", CP2 + ["parallel.dp=2"] + DISTOPT, ["llama_long"]),
        ("cp2_dp2_ep2_distopt", CP2 + ["parallel.dp=2"] + EP2 + DISTOPT + FP32, ["llama_moe"]),
        ("dp4_hsdp", ["parallel.dp=4"] + SHARD2, ["gpt2", "llama"]),
        ("cp2_dp2_ep2_fsdp", CP2 + ["parallel.dp=2"] + EP2 + SHARD2, ["llama_moe"]),
        ("tp2_dp2_fsdp_sp", TP + SP + ["parallel.dp=2"] + SHARD2, ["gpt2_dropout"]),
        ("pp2_dp2_fsdp_full", ["parallel.pp=2", "parallel.dp=2"] + SHARD2 + FULL, ["llama"]),
        # FSDP2 over dp_shard x cp: the cp ranks' grads summed in its reduce-scatter.
        ("cp2_dp2_fsdp", CP2 + ["parallel.dp=2"] + SHARD2, ["llama_long"]),
        # Experts sharded over dp_shard / ep (2, then 1: HSDP's replicas alone).
        ("dp4_ep2_fsdp", ["parallel.dp=4"] + EP2 + ["parallel.dp_shard=4"], ["llama_moe"]),
        ("dp4_ep2_hsdp", ["parallel.dp=4"] + EP2 + SHARD2, ["llama_moe"])],
    8: [("tp2_pp2_dp2", THREE_D, ["gpt2", "llama", "gpt2_untied", "llama_tied", "llama_moe"]),
        ("tp2_pp2_dp2_sp_distopt", THREE_D + SP + DISTOPT, ["gpt2", "llama", "gpt2_documents"]),
        ("tp2_dp4_ep2_distopt", TP + ["parallel.dp=4"] + EP2 + DISTOPT, ["llama_moe"]),
        ("tp2_pp2_dp2_partition_uniform2", THREE_D + PARTITION + ["model.recompute_layers=2"],
         ["gpt2_dropout"]),
        ("tp2_pp2_cp2_distopt", TP + ["parallel.pp=2"] + CP2 + DISTOPT, ["llama_long"]),
        ("cp4_dp2", CP4 + ["parallel.dp=2"], ["gpt2_long_dropout"]),
        ("tp2_pp2_dp2_fsdp_sp", THREE_D + SP + SHARD2, ["gpt2", "llama_tied"]),
        ("pp2_vpp2_dp4_hsdp", ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=4",
                               "train.micro_batch_size=1"] + SHARD2, ["gpt2"]),
        ("cp2_dp4_hsdp", CP2 + ["parallel.dp=4"] + SHARD2, ["gpt2_long_dropout"])],
}


def cases(world: int, corpus: str = CORPUS) -> list[Case]:
    return [Case(f"{name}_{variant}", [o.replace(CORPUS, corpus) for o in
                                       overrides + VARIANTS[variant]], dump_grads=True)
            for name, overrides, variants in LAYOUTS[world] for variant in variants]


def write_documents(prefix: Path) -> None:
    """Short documents of a few words, each closed by the byte tokenizer's eod."""
    words = random.Random(0).choices(["the", "cat", "sat", "on", "a", "mat", "ran"], k=900)
    tokenizer = ByteTokenizer()
    with IndexedDatasetWriter(prefix, "uint16") as writer:
        for i in range(0, len(words), 3):
            text = " ".join(words[i:i + 3])[:random.Random(i).randint(1, 11)]
            writer.add_document(tokenizer.encode(text) + [tokenizer.eod_id])
        writer.finalize()


ALL_CASES = [c.name for world in LAYOUTS for c in cases(world)]


def variant_of(case: str) -> str:
    return max((v for v in VARIANTS if case.endswith("_" + v)), key=len)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("equivalence")
    corpus = str(out / "documents")
    write_documents(Path(corpus))
    for variant, overrides in VARIANTS.items():
        overrides = [o.replace(CORPUS, corpus) for o in overrides]
        run_reference(Case(f"ref_{variant}", overrides, dump_grads=True), out)
    for world in LAYOUTS:
        run_cases(world, cases(world, corpus), out)
    return out


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


@pytest.mark.parametrize("case", ALL_CASES)
def test_loss_trajectory_matches_single_process(runs, case):
    expected, got = losses(runs / f"ref_{variant_of(case)}"), losses(runs / case)
    assert len(got) == len(expected) == 10
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        assert abs(g - e) <= 1e-5 * abs(e), f"step {step}: {g} vs single-process {e}"
    assert expected[-1] < expected[0] - 0.15 # it is learning, so the comparison means something


@pytest.mark.parametrize("case", ALL_CASES)
def test_gradients_match_single_process(runs, case):
    expected = load_grads(runs / f"ref_{variant_of(case)}")
    got = load_grads(runs / case)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key].shape == expected[key].shape, key
        torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_distributed_optimizer_shards_state(runs, flavour):
    """Per-rank AdamW state is ~1/dp of the unsharded optimizer's (within 10%)."""
    def state_bytes(case: str) -> list[int]:
        return [int((runs / case / f"opt_state_bytes.{r}").read_text()) for r in range(2)]

    whole = state_bytes(f"dp2_{flavour}")[0]
    for got in state_bytes(f"dp2_distopt_{flavour}"):
        assert abs(got - whole / 2) <= 0.1 * whole / 2, (got, whole)


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_sharded_data_shards_state(runs, flavour):
    """Under FSDP2 (dp_shard=2) each rank's AdamW state is ~1/2 of the
    replicated optimizer's (within 10%), as ZeRO-1's is."""
    def state_bytes(case: str) -> list[int]:
        return [int((runs / case / f"opt_state_bytes.{r}").read_text()) for r in range(2)]

    whole = state_bytes(f"dp2_{flavour}")[0]
    for got in state_bytes(f"dp2_fsdp_{flavour}"):
        assert abs(got - whole / 2) <= 0.1 * whole / 2, (got, whole)


def test_masked_eval_matches_single_process(runs):
    """Eval masks the held-out windows as training does, on every stage."""
    def evals(case: str) -> list[float]:
        return [r["eval_loss"] for r in read_metrics(runs / case) if "eval_loss" in r]

    expected, got = evals("ref_gpt2_documents"), evals("tp2_pp2_dp2_sp_distopt_gpt2_documents")
    assert len(got) == len(expected) == 1
    assert abs(got[0] - expected[0]) <= 1e-5 * abs(expected[0]), (got, expected)


MOE_CASES = [c for c in ALL_CASES if variant_of(c) == "llama_moe"]


@pytest.mark.parametrize("case", MOE_CASES)
def test_routing_figures_are_the_single_process_runs(runs, case):
    """The step's summed routing counters (train/routing_figures.py) at
    every layout: each layer, whichever pipeline stage holds it, its tokens
    per expert summed over the data-parallel ranks (the expert-parallel ones
    too), as one process counts them."""
    expected = [r for r in read_metrics(runs / "ref_llama_moe") if "loss" in r]
    got = [r for r in read_metrics(runs / case) if "loss" in r]
    tokens = 8 * 16 * 2  # global batch x seq_len x top_k, per layer
    assert {layer: sum(counts) for layer, counts in got[-1]["moe_load"].items()} == \
        {"1": tokens, "2": tokens, "3": tokens}
    assert got[-1]["moe_load"] == expected[-1]["moe_load"]
    for e, g in zip(expected, got):
        assert g["moe_dropped_share"] == 0.0
        for key in ("moe_aux_loss", "moe_z_loss", "moe_imbalance"):
            assert g[key] == pytest.approx(e[key], rel=1e-5), (g["step"], key)
