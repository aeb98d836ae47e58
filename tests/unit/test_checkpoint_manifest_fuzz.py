"""Issue 27 items 1 and 5: every byte a resume reads from a manifest or a
local shard's meta.json is covered by the digest in the completion marker,
and every damaged metadata file is a CheckpointError naming it (skipped and
walked back from), never a KeyError or a huge allocation."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.validation import read_manifest
from megaresil.checkpoint.offline.inspect import verify
from megaresil.checkpoint.local.shard import Shard, add_checksums, stage
from megaresil.checkpoint.local.store import NodeStore
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.state import RunRecord

LAYOUT = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1}


def saved_checkpoint(root: Path, step: int = 3, backend: str = "torch_dist",
                     rects: list[Rect] | None = None) -> Path:
    ckpt = Checkpointer(root, backend, group=None, asynchronous=False, keep=0,
                        events=type("E", (), {"emit": lambda *a, **k: None})(),
                        device=torch.device("cpu"))
    rects = rects or [Rect("w", (4, 3), (0, 0), torch.arange(12.0).view(4, 3))]
    state = RunRecord(step=step, layout=LAYOUT, recipe={"optimizer": {"lr": 0.1}},
                     consumed_samples=240, optimizer_steps=step)
    ckpt.save(rects, state, rank_state={"seed": 5})
    ckpt.close()
    return root / fmt.step_dir_name(step)


def flipped(data: bytes, sample: int, seed: int = 0) -> list[bytes]:
    """`data` with one bit flipped at each of a seeded sample of byte positions."""
    rng = random.Random(seed)
    positions = rng.sample(range(len(data)), min(sample, len(data)))
    return [data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
            for i in positions]


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_every_flip_of_a_manifest_byte_is_refused(tmp_path, backend):
    directory = saved_checkpoint(tmp_path, backend=backend)
    assert verify(directory) is None
    manifest = directory / fmt.MANIFEST
    original = manifest.read_bytes()
    for variant in flipped(original, 300):
        manifest.write_bytes(variant)
        with pytest.raises(fmt.CheckpointError):
            read_manifest(directory)
        assert verify(directory)  # `ckpt verify` says INVALID, no traceback
    manifest.write_bytes(original)
    assert verify(directory) is None


def test_consumed_samples_changed_is_invalid_not_resumed(tmp_path):
    """The issue's case: 240 -> 248 passed verify and the resume."""
    directory = saved_checkpoint(tmp_path)
    manifest = directory / fmt.MANIFEST
    manifest.write_text(manifest.read_text().replace('"consumed_samples": 240',
                                                     '"consumed_samples": 248'))
    assert "does not match the digest" in verify(directory)



def test_a_flipped_latest_never_chooses_the_checkpoint(tmp_path):
    """`latest` carries no checksum, so nothing lets it choose: a resume lists
    the step directories, and a run directory or root resolves to the same
    newest valid checkpoint, whatever `latest` says; a damaged `latest` named
    by the user is refused or names a real step beside it."""
    from megaresil.checkpoint.location import resolve_checkpoint
    from megaresil.train.checkpointing import candidates

    saved_checkpoint(tmp_path, step=3)
    newest = saved_checkpoint(tmp_path, step=5)
    latest = tmp_path / fmt.LATEST
    original = latest.read_bytes()
    assert original.strip() == newest.name.encode()
    every_bit = [original[:i] + bytes([original[i] ^ (1 << bit)]) + original[i + 1:]
                 for i in range(len(original)) for bit in range(8)]
    crafted = [b"step_0000003\n", b"../../etc\n", b"step_0000003/../../x\n", b""]
    for variant in every_bit + crafted:
        latest.write_bytes(variant)
        assert candidates("auto", tmp_path, job_started=0.0)[0] == newest
        assert resolve_checkpoint(tmp_path)[0] == newest
        try:
            named, _ = resolve_checkpoint(latest)
        except fmt.CheckpointError as err:
            assert "not a step directory" in str(err)
        else:
            assert named.parent == tmp_path and named.name in ("step_0000003", "step_0000005")

def test_a_damaged_marker_is_refused(tmp_path):
    directory = saved_checkpoint(tmp_path)
    marker = directory / fmt.MARKER
    for variant in flipped(marker.read_bytes(), 40):
        marker.write_bytes(variant)
        assert verify(directory)


def legacy(directory: Path, manifest: dict) -> None:
    """A manifest as an older megaresil wrote it: a bare `ok` marker."""
    (directory / fmt.MANIFEST).write_text(json.dumps(manifest))
    (directory / fmt.MARKER).write_text("ok\n")


def test_an_old_checkpoint_without_a_digest_still_reads(tmp_path):
    directory = saved_checkpoint(tmp_path)
    legacy(directory, json.loads((directory / fmt.MANIFEST).read_text()))
    assert verify(directory) is None


@pytest.mark.parametrize("damage", [
    lambda m: m["tensors"]["w"].update(global_shape=[-4, 3]),
    lambda m: m["tensors"]["w"].update(global_shape=[2**40, 3]),
    lambda m: m["tensors"]["w"]["shards"][0].update(shape=[2**40, 3]),
    lambda m: m.update(backend="tape"),
    lambda m: m.pop("data"),
    lambda m: m["optimizer"].pop("adam_step"),
    lambda m: m.update(step="7"),
    lambda m: m["tensors"]["w"].update(dtype="float128"),
])
def test_damaged_metadata_is_a_checkpoint_error_naming_the_file(tmp_path, damage):
    directory = saved_checkpoint(tmp_path)
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    damage(manifest)
    legacy(directory, manifest)
    with pytest.raises(fmt.CheckpointError, match=f"{directory.name}/{fmt.MANIFEST}"):
        read_manifest(directory)
    assert verify(directory)


RUN_ID = "0123456789abcdef"


def local_shard(step: int = 4) -> Shard:
    data, records = stage([Rect("w", (4,), (0,), torch.arange(4.0))], None)
    add_checksums(data, records)
    run = RunRecord(step=step, layout=LAYOUT, recipe={"optimizer": {}}, consumed_samples=80,
                   optimizer_steps=step).to_manifest()
    return Shard({"format": "megaresil-local-shard", "version": 1, "run_id": RUN_ID,
                  "step": step, "owner": 0, "world": 1, "layout": LAYOUT, "run": run,
                  "rank_state": {"seed": 1}, "rects": records}, data.clone())


def test_every_flip_of_a_local_meta_byte_is_refused(tmp_path):
    store = NodeStore(tmp_path / "node_0")
    store.write(local_shard())
    meta = store.shard_dir(4, 0) / "meta.json"
    original = meta.read_bytes()
    assert store.read_meta(4, 0)["run"]["data"]["consumed_samples"] == 80
    for variant in flipped(original, 300):
        meta.write_bytes(variant)
        with pytest.raises(fmt.CheckpointError):
            store.read_meta(4, 0)
        assert store.report(LAYOUT, 1, RUN_ID)[4][0]  # a problem: the step is not chosen


def test_a_local_meta_without_rects_is_a_checkpoint_error(tmp_path):
    store = NodeStore(tmp_path / "node_0")
    shard = local_shard()
    del shard.meta["rects"]
    store.write(shard)
    with pytest.raises(fmt.CheckpointError, match="rects"):
        store.read_meta(4, 0)


# --- issue 27 item 2: the recipe on resume ------------------------------------------------

def model_rects(model) -> list[Rect]:
    """Zeros for each weight of `model` (a ModelConfig), at its checkpoint shape."""
    from megaresil.model.gpt import layout_free_shapes

    return [Rect(f"model/{key}", shape, (0,) * len(shape), torch.zeros(shape))
            for key, shape in layout_free_shapes(model).items()]


def resume_refusal(tmp_path, *overrides: str, saved_with: tuple[str, ...] = ()) -> str:
    """Save a checkpoint of the gpt-tiny recipe (with `saved_with`) in a run
    dir, then check a resume of it with `overrides`: the launcher's refusal
    ('' when allowed)."""
    from megaresil.checkpoint.recipe_check import check_resume_recipe
    from megaresil.config import ConfigError, load_recipe, to_dict

    base = [f"run.dir={tmp_path}"]
    recipe = load_recipe("recipes/gpt-tiny.yaml", base + list(saved_with))
    directory = saved_checkpoint(tmp_path / "checkpoints", rects=model_rects(recipe.model))
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    manifest["recipe"] = to_dict(recipe)
    (directory / fmt.MANIFEST).write_text(json.dumps(manifest))
    (directory / fmt.MARKER).write_text("ok\n")
    try:
        check_resume_recipe(load_recipe("recipes/gpt-tiny.yaml", base + list(overrides)))
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.parametrize("change, key", [("model.dropout=0.1", "model.dropout"),
                                         ("train.seed=7", "train.seed"),
                                         ("data.seq_len=32", "data.seq_len")])
def test_a_resume_with_another_recipe_is_refused_naming_the_key(tmp_path, change, key):
    refusal = resume_refusal(tmp_path, change)
    assert f"{key}: the checkpoint has" in refusal and "allow_recipe_change=[" in refusal
    assert "init_from=" in refusal and "run.dir" in refusal
    assert "\nFix: " in refusal  # the fix starts its own line, after the list of keys


def test_a_resume_into_a_model_of_other_shapes_offers_only_a_new_run(tmp_path):
    """Issue 47 item 7: the checkpoint's tensors cannot load into a model of
    other shapes, by a resume or by init_from: only a new run.dir can work.
    (Allowed anyway, the workers' load refuses it naming the tensors:
    tests/multirank/test_checkpoint.py.)"""
    for run, change in enumerate(("model.num_layers=2", "model.vocab_size=4000")):
        refusal = resume_refusal(tmp_path / str(run), change)
        assert f"{change.split('=')[0]}: the checkpoint has" in refusal, refusal
        assert "other shapes than the checkpoint's" in refusal
        assert refusal.endswith("Fix: use a new run.dir (the new model trains from its own "
                                "initialisation).")
        assert "allow_recipe_change=[" not in refusal and "init_from=" not in refusal
    key = "model.num_layers"
    assert resume_refusal(tmp_path / "2", f"{key}=2", f"checkpoint.allow_recipe_change=[{key}]") \
        == ""


def test_a_resume_into_another_architecture_of_the_same_shapes_offers_no_init_from(tmp_path):
    """num_heads splits gpt2's fused qkv otherwise (same shapes): a resume that
    allows it loads; init_from refuses another architecture, so is not offered."""
    refusal = resume_refusal(tmp_path, "model.num_heads=2")
    assert "model.num_heads: the checkpoint has 6, this recipe 2" in refusal
    assert "allow_recipe_change=[model.num_heads]" in refusal and "init_from=" not in refusal
    assert resume_refusal(tmp_path / "allowed", "model.num_heads=2",
                          "checkpoint.allow_recipe_change=[model.num_heads]") == ""


def test_a_checkpoint_that_named_the_tokenizer_resumes_under_a_recipe_that_leaves_it_unset(
        tmp_path):
    """Saved recipes named data.tokenizer=bpe (the old default, and the demo
    piece's); unset, it resolves to the same tokenizer for the same data."""
    assert resume_refusal(tmp_path, saved_with=("data.tokenizer=bpe",)) == ""
    refusal = resume_refusal(tmp_path / "other", saved_with=("data.tokenizer=gpt2",))
    assert "data.tokenizer: the checkpoint has 'gpt2', this recipe 'bpe'" in refusal


def test_allowed_changes_resume(tmp_path):
    assert resume_refusal(tmp_path, "parallel.dp=2", "train.steps=50", "logging.log_interval=3") == ""
    # ZeRO-1 on or off: the moments are stored whole, its row shards reshard as any layout does
    assert resume_refusal(tmp_path / "zero1", "parallel.dp=2", "optimizer.distributed=true") == ""
    assert resume_refusal(tmp_path, "train.seed=7",
                          "checkpoint.allow_recipe_change=[train.seed]") == ""


def test_a_resume_may_change_train_steps_but_not_the_lr_schedule(tmp_path):
    """The resume rule of the LR (docs/checkpoints.md): a step trains at
    lr_at(step, the resumed recipe), so train.steps may change (a wsd run
    extended in its stable phase goes on as the longer run); a schedule key
    is refused unless allowed."""
    wsd = ("optimizer.decay_style=wsd", "optimizer.wsd_decay_steps=20")
    assert resume_refusal(tmp_path, *wsd, "train.steps=500", saved_with=wsd) == ""
    refusal = resume_refusal(tmp_path / "knob", wsd[0], "optimizer.wsd_decay_steps=40",
                             saved_with=wsd)
    assert "optimizer.wsd_decay_steps: the checkpoint has 20, this recipe 40" in refusal
    assert "allow_recipe_change=[optimizer.wsd_decay_steps]" in refusal
    assert "optimizer.decay_style: the checkpoint has 'cosine', this recipe 'wsd'" in \
        resume_refusal(tmp_path / "style", *wsd)


def test_a_resume_that_moves_the_lr_by_train_steps_says_so(tmp_path):
    """Saved at step 3 of 250: raised to 500 steps, a run still in its warmup
    (20 steps) trains on alike (no line); one past it (2 steps) has its
    cosine stretched (a line)."""
    from megaresil.config import load_recipe
    from megaresil.launch.preflight import resumed_lr_line

    for warmup, moved in ((20, False), (2, True)):
        saved = (f"run.dir={tmp_path / str(warmup)}", f"optimizer.warmup_steps={warmup}")
        resume_refusal(tmp_path / str(warmup), saved_with=saved)  # the checkpoint, step 3
        assert resumed_lr_line(load_recipe("recipes/gpt-tiny.yaml", list(saved))) is None
        line = resumed_lr_line(load_recipe("recipes/gpt-tiny.yaml", [*saved, "train.steps=500"]))
        assert (line is not None) == moved
    assert "step 4 trains at" in line and "had 250" in line


def test_a_key_the_checkpoint_predates_is_no_change_at_its_default():
    """A checkpoint saved before train.z_loss and optimizer.decay_style
    existed resumes under their defaults (what its code did), not under others."""
    from megaresil.checkpoint.recipe_check import recipe_changes
    from megaresil.config import load_recipe, to_dict

    new = to_dict(load_recipe("recipes/gpt-tiny.yaml", []))
    older = {**new, "train": dict(new["train"]), "optimizer": dict(new["optimizer"])}
    del older["train"]["z_loss"], older["optimizer"]["decay_style"]
    assert recipe_changes(older, new, []) == []
    z_on = to_dict(load_recipe("recipes/gpt-tiny.yaml", ["train.z_loss=0.1"]))
    assert recipe_changes(older, z_on, []) == [("train.z_loss", None, 0.1)]


def test_a_changed_recipe_is_refused_under_a_torchrun_of_the_users_own(tmp_path):
    """No megaresil launcher checked the recipe: the worker does, before it
    trains (it resumed the checkpoint's tensors into another run)."""
    import os
    import subprocess
    import sys

    from megaresil.config import load_recipe, to_dict
    from megaresil.run_lock import HELD_ENV
    from tests.harness.cli import ROOT

    run = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
           f"run.dir={tmp_path}"]
    directory = saved_checkpoint(tmp_path / "checkpoints")
    manifest = json.loads((directory / fmt.MANIFEST).read_text())
    manifest["recipe"] = to_dict(load_recipe(run[0], run[1:]))
    (directory / fmt.MANIFEST).write_text(json.dumps(manifest))
    (directory / fmt.MARKER).write_text("ok\n")
    env = {k: v for k, v in os.environ.items() if k != HELD_ENV}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29593")
    result = subprocess.run([sys.executable, "-m", "megaresil", "train", *run, "optimizer.lr=0.5"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "optimizer.lr: the checkpoint has" in result.stderr


def test_a_restart_resumes_what_the_job_saved_not_where_it_started(tmp_path):
    """checkpoint.load=PATH (or none) says where a job starts; a restart after
    it saved goes on from its own newest, never back (the steps since lost)."""
    import os

    from megaresil.train.checkpointing import candidates

    start = saved_checkpoint(tmp_path / "elsewhere", step=3)
    before = saved_checkpoint(tmp_path / "root", step=2)  # an older run's, in the same root
    os.utime(before / fmt.MARKER, (100.0, 100.0))
    assert candidates(str(start), tmp_path / "root", job_started=200.0) == [start]
    assert candidates("none", tmp_path / "root", job_started=200.0) == []
    own = saved_checkpoint(tmp_path / "root", step=6)  # saved by this job, after it started
    os.utime(own / fmt.MARKER, (300.0, 300.0))
    assert candidates(str(start), tmp_path / "root", job_started=200.0) == [own, start]
    assert candidates("none", tmp_path / "root", job_started=200.0) == [own]
