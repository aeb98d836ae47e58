"""Megatron checkpoints in (checkpoint/megatron/): checkpoints that
Megatron-Core saved with its own dist_checkpointing (the session's
`mcore_checkpoints`: llama and gpt2 at tp=1, tp=2 and pp=2, llama with
experts at ep=1 and ep=2, qwen2's q/k/v biases and qwen3's q/k norms at
tp=2, qwen3-moe at ep=2) imported by
`megaresil convert --from-megatron` give Megatron-Core's logits, at any
layout; `ckpt inspect` recognises them; bad input is one line."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.megatron import names
from megaresil.checkpoint.megatron.directory import TRACKER
from megaresil.checkpoint.megatron.reading import import_from_megatron, open_megatron
from megaresil.checkpoint.offline.convert import Target
from megaresil.checkpoint.offline.diff import diff_checkpoints
from megaresil.config import load_recipe
from megaresil.events import read_events
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.loop import Trainer
from tests.harness.hf import megaresil_model
from tests.harness.mcore import FLAVOURS, ITERATION, RECIPE, TINY, Saved, fixed_tokens

SAVED = ["llama-tp1-pp1", "llama-tp2-pp1", "gpt2-tp1-pp1", "gpt2-tp2-pp1", "llama-tp1-pp2",
         "moe-tp1-pp1", "moe-tp1-pp1-ep2", "qwen2-tp2-pp1", "qwen3-tp2-pp1",
         "qwen3moe-tp1-pp1-ep2", "llama3-tp2-pp1", "moebias-tp1-pp1-ep2"]
TP1 = Target(tp=1, pp=1, dp=1)


def imported(saves: dict[str, Path], name: str, out: Path, target: Target = TP1) -> Path:
    return import_from_megatron(saves[name], out / name, target)


@pytest.mark.parametrize("name", SAVED)
def test_import_gives_megatron_cores_logits(mcore_checkpoints, name, tmp_path):
    checkpoint = imported(mcore_checkpoints, name, tmp_path)
    model = megaresil_model(checkpoint)
    cfg = Saved(name.split("-")[0]).recipe()
    with torch.no_grad():
        ours = model.logits(fixed_tokens(cfg))[..., :cfg.model.vocab_size]
    theirs = torch.load(mcore_checkpoints[name] / "logits.pt")[..., :cfg.model.vocab_size]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert json.loads((checkpoint / fmt.MANIFEST).read_text())["step"] == ITERATION


def newer_format(save: Path, out: Path, common_extra: dict | None = None) -> Path:
    """`save` as Megatron-Core writes it since Megatron-LM PR #5160: no
    common.pt, the common state a `common_state` object in DCP's files; with
    an optimizer tensor beside the weights, as Megatron-LM saves one."""
    iteration = save / f"iter_{ITERATION:07d}"
    common = torch.load(iteration / "common.pt", weights_only=False)  # the test's own file
    ckpt = open_megatron(save)
    tensors = {key: torch.empty(shape, dtype=ckpt.dtypes[key]) for key, shape in ckpt.shapes.items()}
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(iteration)), no_dist=True)
    blob = io.BytesIO()
    torch.save([{**common, **(common_extra or {})}], blob)
    blob.seek(0)
    dcp.save({**tensors, "optimizer.state.exp_avg.output_layer.weight": torch.zeros(3),
              "common_state/shard_0_1": blob},
             storage_writer=dcp.FileSystemWriter(str(out / iteration.name)), no_dist=True)
    (out / TRACKER).write_text(str(ITERATION))
    shutil.copy(save / "logits.pt", out / "logits.pt")
    return out


def test_the_common_state_inside_dcp_files_reads_too(mcore_checkpoints, tmp_path):
    newer = newer_format(mcore_checkpoints["llama-tp2-pp1"], tmp_path / "save")
    ckpt = open_megatron(newer)
    assert ckpt.iteration == ITERATION and ckpt.args.tensor_model_parallel_size == 2
    assert diff_checkpoints(imported({"newer": newer}, "newer", tmp_path),
                            imported(mcore_checkpoints, "llama-tp2-pp1", tmp_path)).within


def test_a_class_that_is_not_megatrons_is_not_unpickled(mcore_checkpoints, tmp_path):
    crafted = newer_format(mcore_checkpoints["gpt2-tp1-pp1"], tmp_path / "crafted",
                           {"payload": os.system})
    with pytest.raises(fmt.CheckpointError, match="names posix.system, which is not Megatron's"):
        open_megatron(crafted)


def test_import_at_another_layout_holds_the_same_weights(mcore_checkpoints, tmp_path):
    """tp=2 x pp=2 from the tp=2 save: tensor for tensor the tp=1 import's."""
    one = imported(mcore_checkpoints, "llama-tp2-pp1", tmp_path / "one")
    other = imported(mcore_checkpoints, "llama-tp2-pp1", tmp_path / "other",
                     Target(tp=2, pp=2, dp=1))
    assert diff_checkpoints(one, other).within


def test_the_table_names_every_tensor_mcore_writes(mcore_checkpoints):
    """Each key of Mcore's files is a table row's first spelling (stacked,
    or per layer where a model mixes dense and expert layers)."""
    written = {n.theirs[0] for n in names.TOP} | {names.stacked(n.theirs[0]) for n in names.LAYER}
    for name in SAVED:
        ckpt = open_megatron(mcore_checkpoints[name])
        held = {re.sub(r"^decoder\.layers\.\d+\.", names.LAYERS, key) for key in ckpt.shapes}
        assert held <= written, name
        assert ckpt.skipped and all(names.is_extra_state(k) for k in ckpt.skipped)


def test_inspect_says_what_it_holds_and_the_import_command(mcore_checkpoints, cli_main):
    out = cli_main("ckpt", "inspect", str(mcore_checkpoints["llama-tp2-pp1"])).stdout
    assert "iteration   7" in out and "tp=2 pp=1" in out and "flavour=llama" in out
    assert "megaresil convert --from-megatron" in out


def test_bad_input_is_one_line(mcore_checkpoints, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(mcore_checkpoints["gpt2-tp1-pp1"], save)
    (save / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(fmt.CheckpointError, match="names '9'.*Fix: give the iter_NNNNNNN"):
        import_from_megatron(save, tmp_path / "dst", TP1)
    imported_once = imported(mcore_checkpoints, "gpt2-tp1-pp1", tmp_path)
    with pytest.raises(fmt.CheckpointError, match="is a megaresil checkpoint, not Megatron's"):
        import_from_megatron(imported_once, tmp_path / "dst", TP1)
    (save / "iter_0000007" / "common.pt").unlink()
    with pytest.raises(fmt.CheckpointError, match="has no common state"):
        import_from_megatron(save / "iter_0000007", tmp_path / "dst", TP1)


def test_a_damaged_file_is_named_and_nothing_is_written(mcore_checkpoints, tmp_path):
    """Megatron's files carry no digest: a truncated one is found as it is
    read, said in one line, and no checkpoint is left behind."""
    save = tmp_path / "save"
    shutil.copytree(mcore_checkpoints["llama-tp1-pp1"], save)
    chunk = sorted((save / "iter_0000007").glob("*.distcp"))[0]
    os.truncate(chunk, chunk.stat().st_size - 100)
    with pytest.raises(fmt.CheckpointError, match=f"{chunk.name} is unreadable.*damaged"):
        import_from_megatron(save, tmp_path / "dst", TP1)
    assert not list(tmp_path.glob("dst*"))


def test_a_run_starts_from_one(mcore_checkpoints, tmp_path):
    """checkpoint.init_from=SAVE_DIR: a step trained from its weights."""
    save = mcore_checkpoints["llama-tp1-pp1"]
    cfg = load_recipe(RECIPE, TINY + FLAVOURS["llama"] + [
        f"checkpoint.init_from={save}", f"run.dir={tmp_path}", "train.steps=1",
        "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.eval_batches=0", "checkpoint.interval=0",
        "logging.progress=false", "logging.tensorboard=false"])
    Trainer(cfg, ParallelLayout(device=torch.device("cpu"))).run()
    started = [e for e in read_events(tmp_path) if e["event"] == "initialized_from"]
    assert [e["source"] for e in started] == ["megatron"]


def test_verify_reads_every_tensor_whole(mcore_checkpoints, tmp_path, cli_main):
    """Megatron saves no checksums: `ckpt verify` reads each tensor and says
    so; a truncated file, or a NaN in a weight, is INVALID (exit 1)."""
    ok = cli_main("ckpt", "verify", str(mcore_checkpoints["llama-tp2-pp1"]))
    assert "read whole, every value finite; Megatron saves no checksums" in ok.stdout
    save = mcore_checkpoints["llama-tp1-pp1"]
    iteration = save / f"iter_{ITERATION:07d}"
    ckpt = open_megatron(save)
    tensors = {key: torch.empty(shape, dtype=ckpt.dtypes[key]) for key, shape in ckpt.shapes.items()}
    dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(iteration)), no_dist=True)
    tensors["decoder.final_layernorm.weight"][3] = float("nan")
    nan = tmp_path / "nan"
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(nan / iteration.name)), no_dist=True)
    shutil.copy(iteration / "common.pt", nan / iteration.name / "common.pt")
    (nan / TRACKER).write_text(str(ITERATION))
    bad = cli_main("ckpt", "verify", str(nan), check=False)
    assert bad.returncode == 1
    assert "INVALID" in bad.stdout and "decoder.final_layernorm.weight (1)" in bad.stdout
    chunk = sorted((nan / iteration.name).glob("*.distcp"))[0]
    os.truncate(chunk, chunk.stat().st_size - 100)
    assert "is unreadable" in cli_main("ckpt", "verify", str(nan), check=False).stdout
