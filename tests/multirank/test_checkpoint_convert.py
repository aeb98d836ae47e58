"""`megaresil convert` and `megaresil ckpt diff`: round trips over a grid of
layouts and both backends, resuming training from a converted checkpoint,
Hugging Face out and in (GPT-2, Llama with GQA), streaming memory on a
checkpoint over 1 GB, and bad inputs.

The source checkpoint comes from real training: the tiny GPT-2 of
tests.harness.dist at tp=2 x pp=2 x dp=2 with the distributed optimizer, step 5.
Conversions run in this process (they need no process group).
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from tests.harness.cli import ROOT
from tests.harness.dist import Case, run_cases
from tests.harness.hf import megaresil_model
from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.offline.convert import Target, convert, converted_state
from megaresil.checkpoint.offline.diff import diff_checkpoints
from megaresil.checkpoint.offline.writer import write_checkpoint
from megaresil.checkpoint.offline.planning import planned_rects, recipe_layout
from megaresil.checkpoint.sources import CheckpointSource
from megaresil.checkpoint.state import RunRecord
from megaresil.cli import main
from megaresil.config import RecipeConfig, from_dict, to_dict
from megaresil.events import read_events
from megaresil.events import read_metrics

SOURCE = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "optimizer.distributed=true",
          "train.global_batch_size=16", "checkpoint.backend=torch_dist"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    run_cases(8, [Case("src", SOURCE + ["train.exit_at_step=5"])], out)
    return out / "src" / "checkpoints" / "step_0000005"


def manifest(path: Path) -> dict:
    return json.loads((path / fmt.MANIFEST).read_text())


def shard_table(path: Path) -> dict:
    """Per key, its shards' (offset, shape, writing rank, checksum)."""
    return {key: [(s["offset"], s["shape"], s["rank"], s["checksum"]) for s in entry["shards"]]
            for key, entry in manifest(path)["tensors"].items()}


def assert_identical(a: Path, b: Path) -> None:
    report = diff_checkpoints(a, b)
    assert report.identical, [k for k in report.keys if not k.identical][:3] or report.only_in_a


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".partial-" in p.name or ".replaced-" in p.name]


# --- layouts and backends ------------------------------------------------------------


def test_same_layout_reproduces_the_trainers_own_save(trained, tmp_path):
    """Planned offline, the rects of tp=2 x pp=2 x dp=2 with ZeRO-1 and their
    writers are exactly those the 8 training ranks saved, checksums included;
    the non-tensor state, RNG states included, is carried over."""
    out = convert(trained, tmp_path / "zarr", Target(backend="zarr"))
    assert shard_table(out) == shard_table(trained)
    before, after = manifest(trained), manifest(out)
    assert after["backend"] == "zarr" and after["recipe"]["checkpoint"]["backend"] == "zarr"
    for key in ("step", "layout", "data", "optimizer", "rank_states"):
        assert after[key] == before[key], key
    assert_identical(trained, out)


# (tp, pp, dp, vpp, distributed optimizer, backend) of the intermediate layout B.
GRID = [(1, 1, 1, 1, False, "zarr"), (4, 1, 1, 1, False, "torch_dist"),
        (1, 4, 1, 1, False, "zarr"), (2, 2, 1, 2, False, "torch_dist"),
        (4, 4, 2, 1, True, "zarr"), (1, 2, 4, 2, True, "torch_dist"),
        (2, 1, 4, 1, True, "zarr"), (4, 2, 2, 1, False, "torch_dist"),
        (1, 1, 8, 1, True, "zarr"), (2, 4, 1, 1, True, "torch_dist")]


def grid_id(layout) -> str:
    tp, pp, dp, vpp, zero, backend = layout
    return f"tp{tp}_pp{pp}_dp{dp}_vpp{vpp}_{'zero1' if zero else 'adam'}_{backend}"


@pytest.mark.parametrize("layout", GRID, ids=grid_id)
def test_round_trip_is_bit_identical(trained, tmp_path, layout):
    tp, pp, dp, vpp, zero, backend = layout
    there = convert(trained, tmp_path / "b", Target(tp=tp, pp=pp, dp=dp, vpp=vpp,
                                                    distributed_optimizer=zero, backend=backend))
    assert manifest(there)["layout"] == {"tp": tp, "pp": pp, "dp": dp, "vpp": vpp,
                                         "sequence_parallel": False, "world_size": tp * pp * dp,
                                         "distributed_optimizer": zero and dp > 1}
    assert_identical(trained, there)
    back = convert(there, tmp_path / "a", Target(tp=2, pp=2, dp=2, vpp=1,
                                                 distributed_optimizer=True, backend="torch_dist"))
    assert_identical(trained, back)
    assert shard_table(back) == shard_table(trained)


def test_bytes_are_attributed_to_target_ranks(trained, tmp_path):
    """Replicas are written once and spread over their ranks: at dp=4 the
    four data-parallel replicas of each stage share the writing."""
    out = convert(trained, tmp_path / "dp4", Target(tp=1, pp=2, dp=4, distributed_optimizer=False))
    per_rank = [0] * 8
    for key, entry in manifest(out)["tensors"].items():
        for shard in entry["shards"]:
            per_rank[shard["rank"]] += torch.Size(shard["shape"]).numel() * 4
    for stage in (per_rank[:4], per_rank[4:]):
        assert min(stage) >= 0.7 * sum(stage) / 4, per_rank


def test_weights_only_drops_the_optimizer_state(trained, tmp_path, capsys):
    out = convert(trained, tmp_path / "w", Target(tp=1, pp=1, dp=1, weights_only=True))
    saved = manifest(out)
    assert saved["weights_only"] is True
    assert saved["tensors"] and all(key.startswith("model/") for key in saved["tensors"])
    assert main(["ckpt", "inspect", str(out)]) == 0  # says so before a resume would fail
    assert "(weights only: no optimizer state" in capsys.readouterr().out
    assert main(["ckpt", "diff", str(trained), str(out)]) == 1
    assert "only in A: optim/exp_avg/layers.0.attn.qkv.weight" in capsys.readouterr().out
    assert main(["convert", str(out), str(tmp_path / "again")]) == 1
    assert "--weights-only" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


class Nudged:
    """A checkpoint as a source, with one key's values moved by `delta`."""

    def __init__(self, path: Path, key: str, delta: float):
        self.source, self.key, self.delta = CheckpointSource(path), key, delta
        self.tensors = self.source.tensors

    def read(self, targets) -> None:
        self.source.read(targets)
        for target in targets:
            if target.key == self.key:
                target.tensor.add_(self.delta)


def test_diff_reports_differences_and_honours_tolerances(trained, tmp_path, capsys):
    key = "model/norm.weight"
    saved = manifest(trained)
    cfg = from_dict(saved["recipe"])
    write_checkpoint(Nudged(trained, key, 1e-6), cfg, tmp_path / "nudged", backend="zarr",
                     weights_only=False, state=converted_state(saved, cfg, False), overwrite=False)
    assert main(["ckpt", "diff", str(trained), str(tmp_path / "nudged")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if "DIFFERENT" in line] == [
        line for line in lines if line.startswith(key)]
    assert main(["ckpt", "diff", str(trained), str(tmp_path / "nudged"), "--atol", "1e-5"]) == 0


# --- training resumes from a converted checkpoint ----------------------------------------

RESUME_LAYOUTS = {"pp2_vpp2_dp2": ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2"],
                  "tp4": ["parallel.tp=4"]}
RESUME_TARGETS = {"pp2_vpp2_dp2": Target(tp=1, pp=2, dp=2, vpp=2, distributed_optimizer=False,
                                         backend="zarr"),
                  "tp4": Target(tp=4, pp=1, dp=1, vpp=1)}


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def test_converted_checkpoint_resumes_like_online_resharding(trained, tmp_path):
    cases = []
    for name, layout in RESUME_LAYOUTS.items():
        converted = convert(trained, tmp_path / f"ckpt_{name}", RESUME_TARGETS[name])
        opts = layout + ["train.global_batch_size=16"]
        cases += [Case(f"online_{name}", opts + [f"checkpoint.load={trained}"]),
                  Case(f"converted_{name}", opts + [f"checkpoint.load={converted}"])]
    run_cases(4, cases, tmp_path)
    for name in RESUME_LAYOUTS:
        online = losses(tmp_path / f"online_{name}")
        converted = losses(tmp_path / f"converted_{name}")
        assert sorted(converted) == list(range(6, 11))
        for step in range(6, 11):
            assert abs(converted[step] - online[step]) <= 1e-5 * online[step], (name, step)
        loaded = next(e for e in read_events(tmp_path / f"converted_{name}")
                      if e["event"] == "checkpoint_loaded")
        assert loaded["saved_layout"] == loaded["layout"]


# --- Hugging Face ------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_gpt2_export_loads_in_transformers_with_the_same_logits(trained, tmp_path):
    assert main(["convert", str(trained), "--to-hf", str(tmp_path / "hf")]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert relative_error(hf(tokens).logits, megaresil_model(trained).logits(tokens)) <= 1e-5


def hf_round_trip(hf_model, tmp_path: Path, layout: list[str]) -> tuple[Path, Path]:
    """Save `hf_model`, import it at `layout`, export it again."""
    hf_model.save_pretrained(tmp_path / "hf")
    ckpt, again = tmp_path / "ckpt", tmp_path / "hf_again"
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(ckpt), *layout]) == 0
    assert main(["convert", str(ckpt), "--to-hf", str(again)]) == 0
    return ckpt, again


def assert_same_weights(a: Path, b: Path) -> None:
    from safetensors.torch import load_file

    left, right = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(left) == sorted(right)
    assert all(torch.equal(left[k], right[k]) for k in left)


def random_gpt2(n_positions: int = 128, n_layer: int = 4):
    config = transformers.GPT2Config(vocab_size=300, n_positions=n_positions, n_embd=64,
                                     n_layer=n_layer, n_head=4, resid_pdrop=0, embd_pdrop=0,
                                     attn_pdrop=0)
    return transformers.GPT2LMHeadModel(config).eval()


# GPT-2's freshly initialised biases are all zero, which the zarr backend
# cannot write yet (see test_zarr_writes_all_zero_tensors): torch_dist for it.
@pytest.mark.parametrize("flavour,backend", [("gpt2", "torch_dist"), ("llama_gqa", "zarr")])
def test_hf_import_gives_the_same_logits_and_exports_back_exactly(tmp_path, flavour, backend):
    torch.manual_seed(0)
    if flavour == "gpt2":
        hf, cls = random_gpt2(), transformers.GPT2LMHeadModel
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=False)).eval()
        cls = transformers.LlamaForCausalLM
    ckpt, again = hf_round_trip(hf, tmp_path, ["--tp", "2", "--pp", "2", "--backend", backend])
    saved = manifest(ckpt)
    assert saved["weights_only"] and saved["layout"]["tp"] == 2 and saved["layout"]["pp"] == 2
    assert saved["recipe"]["model"]["flavour"] == flavour.split("_")[0]
    tokens = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        expected = hf(tokens).logits
        assert relative_error(megaresil_model(ckpt).logits(tokens), expected) <= 1e-5
        assert relative_error(cls.from_pretrained(again).eval()(tokens).logits, expected) <= 1e-5
    assert_same_weights(tmp_path / "hf", again)


def test_zarr_writes_all_zero_tensors(tmp_path):
    """zarr skips chunks equal to the fill value unless told not to; the
    zero biases of a fresh GPT-2 must still be written (and fsynced)."""
    random_gpt2(n_layer=1).save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                 "--backend", "zarr"]) == 0
    assert main(["ckpt", "verify", str(tmp_path / "ckpt")]) == 0


def test_hf_import_takes_training_keys_from_a_recipe(tmp_path):
    random_gpt2(n_positions=32, n_layer=2).save_pretrained(tmp_path / "hf")
    (tmp_path / "recipe.yaml").write_text("defaults: [model/gpt-tiny]\n"
                                          "data: {seq_len: 32}\ntrain: {steps: 7}\n")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt"),
                 "--recipe", str(tmp_path / "recipe.yaml")]) == 0
    recipe = manifest(tmp_path / "ckpt")["recipe"]
    assert recipe["train"]["steps"] == 7 and recipe["data"]["seq_len"] == 32
    assert recipe["model"]["num_layers"] == 2 and recipe["model"]["max_seq_len"] == 32


# --- bad inputs: a clear error, non-zero exit, no destination ---------------------------


def copy_of(trained: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(trained, copy)
    return copy


def flip_a_byte(checkpoint: Path) -> None:
    target = max((p for p in checkpoint.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def refused(capsys, argv: list[str], code: int, *needles: str) -> None:
    assert main(argv) == code
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err


def test_missing_incomplete_and_corrupt_sources_are_refused(trained, tmp_path, capsys):
    dst = tmp_path / "dst"
    refused(capsys, ["convert", str(tmp_path / "nowhere"), str(dst)], 1, "does not exist", "Fix:")
    incomplete = copy_of(trained, tmp_path)
    (incomplete / fmt.MARKER).unlink()
    refused(capsys, ["convert", str(incomplete), str(dst)], 1, "no completion marker", "Fix:")
    (incomplete / fmt.MARKER).write_text("ok\n")
    flip_a_byte(incomplete)
    refused(capsys, ["convert", str(incomplete), str(dst), "--tp", "1"], 1, "corrupt",
            "checksum mismatch", "Fix:")
    assert not dst.exists() and not leftovers(tmp_path)


def test_layouts_that_do_not_divide_the_model_name_the_key(trained, tmp_path, capsys):
    dst = tmp_path / "dst"
    refused(capsys, ["convert", str(trained), str(dst), "--tp", "3"], 2, "parallel.tp", "Fix:")
    refused(capsys, ["convert", str(trained), str(dst), "--pp", "3"], 2, "model.num_layers",
            "Fix:")
    refused(capsys, ["convert", str(trained), str(dst), "--dp", "3"], 2,
            "train.global_batch_size", "Fix:")
    assert not dst.exists()


def test_a_model_of_another_depth_is_refused_naming_the_keys(trained, tmp_path, capsys):
    """Converting a 4-layer checkpoint for a 2-layer model would drop layers
    2-3 silently; a pipeline layout, where each rank holds a subset of the
    layers, is the same model (the round trips above)."""
    refused(capsys, ["convert", str(trained), str(tmp_path / "dst"), "--set",
                     "model.num_layers=2"], 1, "does not use", "model/layers.2.", "Fix:")
    assert not (tmp_path / "dst").exists() and not leftovers(tmp_path)


def test_existing_destination_is_replaced_only_with_overwrite(trained, tmp_path, capsys):
    dst = convert(trained, tmp_path / "dst", Target(tp=1, pp=1, dp=1))
    refused(capsys, ["convert", str(trained), str(dst), "--tp", "4"], 1, "already exists",
            "--overwrite")
    assert manifest(dst)["layout"]["tp"] == 1
    assert main(["convert", str(trained), str(dst), "--tp", "4", "--overwrite"]) == 0
    assert manifest(dst)["layout"]["tp"] == 4 and (dst / fmt.MARKER).exists()
    assert_identical(trained, dst)
    assert not leftovers(tmp_path)


def test_unknown_hf_architecture_is_refused(tmp_path, capsys):
    hf_dir = tmp_path / "bert"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    (hf_dir / "model.safetensors").write_bytes(b"")
    refused(capsys, ["convert", "--from-hf", str(hf_dir), str(tmp_path / "dst")], 1,
            "BertForMaskedLM", "GPT2LMHeadModel", "Fix:")
    assert not (tmp_path / "dst").exists()


def test_the_tools_script_is_the_cli(trained, tmp_path):
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", str(trained),
                             str(tmp_path / "dst"), "--tp", "3"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2 and "parallel.tp" in result.stderr
    assert not (tmp_path / "dst").exists()


# --- streaming: memory does not grow with the checkpoint -----------------------------------


class SyntheticWeights:
    """A checkpoint-sized source that holds nothing: each rect's values are
    drawn from a generator seeded by its key and offset when read."""

    def __init__(self, cfg: RecipeConfig):
        rects = planned_rects(cfg, weights_only=False)[0]  # one rank at tp=pp=dp=1: all of it
        self.tensors = {r.key: {"global_shape": list(r.global_shape), "dtype": "float32"}
                        for r in rects}

    def read(self, targets) -> None:
        for target in targets:
            seed = zlib.crc32(f"{target.key}{target.offset}".encode())
            generator = torch.Generator().manual_seed(seed)
            target.tensor.copy_(torch.rand(target.shape, generator=generator))


# The process's own high-water mark from /proc: getrusage's ru_maxrss starts
# at the parent's (Linux carries it over through exec), and pytest, having
# just written the source, is large.
MEASURE = """
import json, sys
import megaresil.checkpoint.offline.convert, megaresil.cli, torch.distributed.checkpoint, zarr

def peak_rss_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

baseline = peak_rss_kib()
code = megaresil.cli.main(sys.argv[1:])
print(json.dumps({"code": code, "baseline_kib": baseline, "peak_kib": peak_rss_kib()}))
"""


def peak_rss_of_convert(*argv: str) -> int:
    """Bytes of peak RSS a `megaresil convert` process adds to its imports."""
    result = subprocess.run([sys.executable, "-c", MEASURE, "convert", *argv], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    measured = json.loads(result.stdout.splitlines()[-1])
    assert measured["code"] == 0
    return (measured["peak_kib"] - measured["baseline_kib"]) * 1024


@pytest.mark.slow
def test_conversion_streams_a_checkpoint_over_1gb(tmp_path):
    """1.3 GB of weights and moments (largest tensor: the 128 MiB embedding)
    convert both ways with at most 2 x the largest tensor + 256 MiB above the
    process's import footprint: memory follows the largest tensor, not the
    checkpoint (a non-streamed conversion would need > 1.3 GB)."""
    recipe = to_dict(RecipeConfig())
    recipe["model"].update(hidden_size=1024, num_layers=6, num_heads=16, vocab_size=32768)
    cfg = from_dict(recipe)
    source = SyntheticWeights(cfg)
    sizes = [torch.Size(e["global_shape"]).numel() * 4 for e in source.tensors.values()]
    assert sum(sizes) >= 2**30
    state = RunRecord(step=1, layout=recipe_layout(cfg), recipe=to_dict(cfg), consumed_samples=16,
                     optimizer_steps=1)
    bound = 2 * max(sizes) + 256 * 2**20
    try:  # 3.9 GB on disk: not left for pytest's temp-dir rotation
        write_checkpoint(source, cfg, tmp_path / "zarr", backend="zarr", weights_only=False,
                         state=state, overwrite=False)
        to_dcp = peak_rss_of_convert(str(tmp_path / "zarr"), str(tmp_path / "dcp"), "--tp", "2",
                                     "--pp", "2", "--dp", "2", "--distributed-optimizer", "on",
                                     "--backend", "torch_dist")
        back = peak_rss_of_convert(str(tmp_path / "dcp"), str(tmp_path / "zarr_again"),
                                   "--tp", "1", "--pp", "1", "--dp", "1", "--backend", "zarr")
        assert to_dcp <= bound and back <= bound, (to_dcp, back, bound)
        assert_identical(tmp_path / "zarr", tmp_path / "zarr_again")
    finally:
        for written in tmp_path.iterdir():
            shutil.rmtree(written, ignore_errors=True)


def _crafted_safetensors(header: dict | None, data: bytes = b"", length: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if header is not None else b""
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize("crafted", [
    _crafted_safetensors(None, b"{}", length=2**62),  # header length 2^62
    _crafted_safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8),
    _crafted_safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "v": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12),
    _crafted_safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
    _crafted_safetensors({"w": {"dtype": "F32", "shape": [2**31, 2**31],
                                "data_offsets": [0, 8]}}, b"\0" * 8),
    _crafted_safetensors({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})[:-3],
], ids=["huge-header", "past-end", "overlapping", "dtype-mismatch", "huge-shape", "truncated"])
def test_crafted_safetensors_give_one_line(cli_main, tmp_path, crafted):
    """Each crafted weights file ends in the one-line error naming the file
    (by the CLI's main() in this process: a subprocess each, importing torch
    again, cost ~7 s a case)."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 8, "n_head": 2,
        "n_positions": 256, "vocab_size": 32}))
    (hf_dir / "model.safetensors").write_bytes(crafted)
    result = cli_main("convert", "--from-hf", str(hf_dir), str(tmp_path / "out"), check=False)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("megaresil: error: ") and "Fix:" in result.stderr
    assert "model.safetensors" in result.stderr and "Traceback" not in result.stderr
