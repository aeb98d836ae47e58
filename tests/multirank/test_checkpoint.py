"""Distributed checkpointing: exact resume, resharding resume, crash safety,
corruption, errors, retention and the ckpt CLI, on both backends."""
from __future__ import annotations

import json
import pickle
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.harness.dist import MOE, Case, recipe_for, run_cases
from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.validation import read_manifest
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.offline.planning import recipe_layout
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.state import RunRecord
from megaresil.config import RecipeConfig, to_dict
from megaresil.events import EventLog, read_events, read_metrics
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.loop import Trainer

BACKENDS = ["torch_dist", "zarr"]
THREE_D = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]
DISTOPT = ["optimizer.distributed=true"]
QUIET = ["logging.progress=false", "logging.tensorboard=false"]


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss, the last line for a step winning (a resumed run appends)."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def ckpt_opts(backend: str, asynchronous: bool) -> list[str]:
    return [f"checkpoint.backend={backend}", f"checkpoint.async={str(asynchronous).lower()}"]


# --- exact resume ----------------------------------------------------------------

EXACT_1 = [(b, a, False) for b in BACKENDS for a in (False, True)]
# At 3D: every backend x saving mode x optimizer kind.
EXACT_3D = [(b, a, d) for b in BACKENDS for a in (False, True) for d in (False, True)]


def exact_name(world: int, backend: str, asynchronous: bool, distopt: bool) -> str:
    return f"exact{world}_{backend}_{'async' if asynchronous else 'sync'}_{'zero1' if distopt else 'adam'}"


def exact_cases(world: int, combos) -> list[Case]:
    layout = THREE_D if world == 8 else []
    return [Case(exact_name(world, b, a, d), layout + ckpt_opts(b, a) + (DISTOPT if d else [])
                 + ["train.exit_at_step=4"], resume=True)
            for b, a, d in combos]


@pytest.fixture(scope="module")
def exact(tmp_path_factory):
    out = tmp_path_factory.mktemp("exact")
    run_cases(1, [Case("straight1")] + exact_cases(1, EXACT_1), out)
    run_cases(8, [Case("straight8_adam", THREE_D), Case("straight8_zero1", THREE_D + DISTOPT)]
              + exact_cases(8, EXACT_3D) + moe_cases(), out)
    return out


def moe_cases() -> list[Case]:
    """A mixture of experts, straight and resumed (3-D expert stacks, ZeRO-1, async)."""
    opts = THREE_D + DISTOPT + MOE
    return [Case("straight8_moe", opts),
            Case("exact8_moe", opts + ckpt_opts("torch_dist", True) + ["train.exit_at_step=4"],
                 resume=True)]


@pytest.mark.parametrize("world,backend,asynchronous,distopt",
                         [(1, *c) for c in EXACT_1] + [(8, *c) for c in EXACT_3D],
                         ids=lambda v: str(v))
def test_resume_is_bit_identical(exact, world, backend, asynchronous, distopt):
    straight = losses(exact / (f"straight{world}" + ("" if world == 1 else
                                                      "_zero1" if distopt else "_adam")))
    run = exact / exact_name(world, backend, asynchronous, distopt)
    resumed = losses(run)
    assert sorted(resumed) == list(range(1, 11))
    for step in range(5, 11):
        assert resumed[step] == straight[step], f"step {step}"
    events = [e["event"] for e in read_events(run)]
    assert events.count("checkpoint_saved") == 1 and "checkpoint_loaded" in events
    saved = next(e for e in read_events(run) if e["event"] == "checkpoint_saved")
    if asynchronous:  # the loop waits for the staging copy, never for the write and commit
        # (how much less depends on the machine's load: the timed promise is
        # test_blocking_seconds_is_what_the_loop_waits_for's, on slow storage)
        assert saved["blocking_seconds"] < saved["seconds"], saved
    else:
        assert saved["blocking_seconds"] == saved["seconds"]
    assert len(saved["bytes_per_rank"]) == world and sum(saved["bytes_per_rank"]) == saved["bytes"]


def test_a_mixture_of_experts_resumes_bit_identically(exact):
    straight, resumed = losses(exact / "straight8_moe"), losses(exact / "exact8_moe")
    assert sorted(resumed) == list(range(1, 11))
    for step in range(5, 11):
        assert resumed[step] == straight[step], f"step {step}"
    tensors = read_manifest(exact / "exact8_moe" / "checkpoints" / "step_0000004")["tensors"]
    assert tensors["model/layers.1.mlp.experts.gate"]["global_shape"] == [4, 96, 64]
    assert tensors["model/layers.1.mlp.router.expert_bias"]["global_shape"] == [4]


def test_replicas_share_the_writing(exact):
    """At tp=2 x pp=2 x dp=2 every rank of a stage writes a similar share
    (with all replicas written by dp rank 0, two ranks per stage would write
    nothing and two twice the mean). The tiny model's padded vocabulary gives
    tp rank 0 more rows than tp rank 1, which no assignment can fully even out."""
    for backend, asynchronous, distopt in EXACT_3D:
        run = exact / exact_name(8, backend, asynchronous, distopt)
        saved = next(e for e in read_events(run) if e["event"] == "checkpoint_saved")
        per_rank = saved["bytes_per_rank"]  # ranks 0-3 hold stage 0, 4-7 stage 1
        for stage in (per_rank[:4], per_rank[4:]):
            mean = sum(stage) / 4
            assert 0.7 * mean <= min(stage) and max(stage) <= 1.3 * mean, per_rank


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dist_files_load_with_plain_dcp(exact):
    """Ranks save without DCP's collectives and one rank merges their plans
    into DCP's global .metadata: plain dcp.load (its own reader and planner)
    reassembles every global tensor of a 3D ZeRO-1 checkpoint, equal to ours."""
    import torch.distributed.checkpoint as dcp

    from megaresil.checkpoint.backends import get_backend

    path = exact / exact_name(8, "torch_dist", False, True) / "checkpoints" / "step_0000004"
    manifest = read_manifest(path)
    ours, plain = {}, {}
    for key, entry in manifest["tensors"].items():
        shape, dtype = tuple(entry["global_shape"]), fmt.torch_dtype(entry["dtype"])
        ours[key] = Rect(key, shape, (0,) * len(shape), torch.empty(shape, dtype=dtype))
        plain[key] = torch.full(shape, float("nan")).to(dtype)
    get_backend("torch_dist").read(path, manifest, list(ours.values()))
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(path / "dcp")), no_dist=True)
    assert len(plain) > 20
    for key, rect in ours.items():
        assert torch.equal(plain[key], rect.tensor), key


# --- resharding resume ----------------------------------------------------------

RESHARD_BATCH = ["train.global_batch_size=16"]
TARGETS = {"tp1_pp1_dp2": (2, ["parallel.dp=2"]),
           "tp1_pp2_vpp2": (2, ["parallel.pp=2", "parallel.vpp=2"]),
           "tp4": (4, ["parallel.tp=4"]),
           "tp1_pp4_dp2": (8, ["parallel.pp=4", "parallel.dp=2"])}


@pytest.fixture(scope="module")
def reshard(tmp_path_factory):
    out = tmp_path_factory.mktemp("reshard")
    saves = [Case(f"save_{b}", THREE_D + DISTOPT + RESHARD_BATCH + ckpt_opts(b, False)
                  + ["train.exit_at_step=5"]) for b in BACKENDS]
    run_cases(8, [Case("straight", THREE_D + DISTOPT + RESHARD_BATCH)] + saves, out)
    for world in (2, 4, 8):
        cases = [Case(f"{name}_{b}", layout + RESHARD_BATCH + [
                     f"checkpoint.load={out / f'save_{b}' / 'checkpoints' / 'step_0000005'}"])
                 for name, (w, layout) in TARGETS.items() if w == world for b in BACKENDS]
        run_cases(world, cases, out)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", TARGETS)
def test_resharding_resume_matches_uninterrupted_run(reshard, target, backend):
    straight = losses(reshard / "straight")
    run = reshard / f"{target}_{backend}"
    resumed = losses(run)
    assert sorted(resumed) == list(range(6, 11))
    for step in range(6, 11):
        assert abs(resumed[step] - straight[step]) <= 1e-5 * straight[step], f"step {step}"
    loaded = next(e for e in read_events(run) if e["event"] == "checkpoint_loaded")
    assert loaded["saved_layout"]["world_size"] == 8 and loaded["saved_layout"]["distributed_optimizer"]


# --- crash safety -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_killed_mid_write_keeps_previous_checkpoint(tmp_path, backend):
    opts = ["parallel.dp=2", "checkpoint.interval=2", "train.steps=6"] + ckpt_opts(backend, False)
    run_cases(2, [Case("straight", opts)], tmp_path)
    with pytest.raises(mp.ProcessExitedException):
        run_cases(2, [Case("crash", opts, kill_rank_in_save=(1, 4))], tmp_path)
    root = tmp_path / "crash" / "checkpoints"
    assert (root / fmt.LATEST).read_text().strip() == "step_0000002"
    assert any(".partial-" in p.name for p in root.iterdir())
    run_cases(2, [Case("crash", opts)], tmp_path)  # the same command again
    events = read_events(tmp_path / "crash")
    loaded = next(e for e in events if e["event"] == "checkpoint_loaded")
    assert loaded["step"] == 2
    assert any(e["event"] == "checkpoint_skipped" and "incomplete" in e["reason"] for e in events)
    assert not any(".partial-" in p.name for p in root.iterdir())
    assert losses(tmp_path / "crash")[6] == losses(tmp_path / "straight")[6]


# --- corruption, errors, retention and the CLI (single process, through the CLI) ---

SINGLE = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "train.eval_batches=0", *QUIET]


def train(cli, run_dir: Path, *extra: str, check: bool = True):
    return cli("train", "recipes/gpt-tiny.yaml", f"run.dir={run_dir}", *SINGLE, *extra,
               check=check)


def flip_a_byte(checkpoint: Path) -> None:
    """Flip one byte in the middle of the largest data file."""
    files = [p for p in checkpoint.rglob("*") if p.is_file() and p.name not in
             (fmt.MANIFEST, fmt.MARKER, ".metadata", "zarr.json")]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_shard_is_caught_and_startup_falls_back(cli, cli_main, tmp_path, backend):
    run = tmp_path / "run"
    opts = [f"checkpoint.backend={backend}", "checkpoint.interval=2", "train.steps=6"]
    train(cli, run, *opts, "train.exit_at_step=4")
    newest = run / "checkpoints" / "step_0000004"
    assert cli_main("ckpt", "verify", str(newest)).returncode == 0
    flip_a_byte(newest)
    result = cli_main("ckpt", "verify", str(newest), check=False)
    assert result.returncode == 1 and "INVALID" in result.stdout
    train(cli, run, *opts)
    events = read_events(run)
    skipped = [e for e in events if e["event"] == "checkpoint_skipped"]
    assert skipped and skipped[0]["path"].endswith("step_0000004")
    assert next(e for e in events if e["event"] == "checkpoint_loaded")["step"] == 2
    assert sorted(losses(run)) == list(range(1, 7))


@pytest.mark.slow
def test_no_valid_checkpoint_refuses_to_start_over(cli, tmp_path):
    run = tmp_path / "run"
    train(cli, run, "train.steps=4", "train.exit_at_step=2")
    flip_a_byte(run / "checkpoints" / "step_0000002")
    result = train(cli, run, "train.steps=4", check=False)
    assert result.returncode != 0
    assert "none is valid" in result.stderr and "checkpoint.load=none" in result.stderr
    train(cli, run, "train.steps=4", "checkpoint.load=none")  # told to start fresh
    assert sorted(losses(run)) == [1, 2, 3, 4]


@pytest.fixture(scope="module")
def step_1(tmp_path_factory) -> Path:
    """The checkpoint of a run stopped after step 1, which the tests below
    load into other models."""
    from tests.harness.cli import megaresil_cli

    run = tmp_path_factory.mktemp("step-1") / "run"
    train(megaresil_cli, run, "train.steps=2", "train.exit_at_step=1")
    return run / "checkpoints" / "step_0000001"


@pytest.mark.slow
def test_a_restart_goes_on_from_what_the_run_saved_not_back_to_checkpoint_load(cli, step_1,
                                                                                tmp_path):
    """checkpoint.load=PATH says where the job starts; after the job saved
    step 2, a failure at step 3 restarts from that save (reloading PATH would
    lose the steps since, and did)."""
    from megaresil.events import read_events

    run = tmp_path / "run"
    train(cli, run, "train.steps=3", "checkpoint.interval=2", f"checkpoint.load={step_1}",
          "faults=[{kind: raise, rank: 0, step: 3}]")
    loaded = [e["path"] for e in read_events(run) if e["event"] == "checkpoint_loaded"]
    assert loaded == [str(step_1), str(run / "checkpoints" / "step_0000002")], loaded


@pytest.mark.slow
def test_other_model_shape_names_key_and_shapes(cli, step_1, tmp_path):
    # past the launcher's recipe check, to the loader's check of the shapes
    result = train(cli, tmp_path / "other", "train.steps=2", "model.hidden_size=96",
                   f"checkpoint.load={step_1}", "checkpoint.allow_recipe_change=[model.hidden_size]",
                   check=False)
    assert result.returncode != 0
    assert "model/embed.positions.weight" in result.stderr
    assert "(128, 192)" in result.stderr and "(128, 96)" in result.stderr


def test_checkpoint_of_another_depth_is_refused_naming_the_keys(tmp_path):
    """A 4-layer checkpoint does not load into a 2-layer model (layers 2-3
    would be ignored), nor a 2-layer one into a 4-layer model (layers 2-3
    left as initialised): one line naming the keys."""
    short = ["train.steps=2", "train.exit_at_step=1"]
    run_cases(1, [Case("four", short), Case("two", short + ["model.num_layers=2"])], tmp_path)

    def load(checkpoint: str, *overrides: str) -> str:
        case = Case("load", [*overrides, f"checkpoint.load={tmp_path / checkpoint}"])
        with pytest.raises(fmt.CheckpointError) as refused:
            Trainer(recipe_for(case, tmp_path / "load"), ParallelLayout(device=torch.device("cpu")))
        return str(refused.value)

    deeper = load("four/checkpoints/step_0000001", "model.num_layers=2")
    assert "does not use" in deeper and "model/layers.2." in deeper and "\n" not in deeper
    shallower = load("two/checkpoints/step_0000001")
    assert "lacks" in shallower and "model/layers.2." in shallower and "\n" not in shallower


@pytest.mark.slow
def test_checkpoint_of_another_depth_is_refused_through_the_cli(cli, step_1, tmp_path):
    # past the launcher's recipe check, to the loader's check of the keys
    result = train(cli, tmp_path / "other", "train.steps=2", "model.num_layers=2",
                   f"checkpoint.load={step_1}", "checkpoint.allow_recipe_change=[model.num_layers]",
                   check=False)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if "does not use" in line]
    assert len(said) == 1 and said[0].startswith("megaresil: giving up: rank ") \
        and "model/layers.2." in said[0], result.stderr


@pytest.mark.slow
def test_inspect_retention_and_format_checks(cli, cli_main, tmp_path):
    run = tmp_path / "run"
    train(cli, run, "train.steps=8", "checkpoint.interval=2", "checkpoint.keep=2",
          "checkpoint.backend=zarr")
    root = run / "checkpoints"
    assert [p.name for p in fmt.committed_checkpoints(root)] == ["step_0000008", "step_0000006"]
    assert (root / fmt.LATEST).read_text().strip() == "step_0000008"
    info = json.loads(cli_main("ckpt", "inspect", str(root / "step_0000008"), "--json").stdout)
    assert info["step"] == 8 and info["backend"] == "zarr" and info["layout"]["world_size"] == 1
    assert info["tensors"]["model/embed.tokens.weight"]["shape"] == [4096, 192]
    assert info["total_bytes"] == sum(info["bytes_per_rank"]) > 0
    assert "model/layers.3.mlp.fc.weight" in \
        cli_main("ckpt", "inspect", str(root / "step_0000008"), "--tensors").stdout

    newer = root / "step_0000006"
    manifest = json.loads((newer / fmt.MANIFEST).read_text())
    # as a newer megaresil would write it: its own manifest, its own digest
    digest = fmt.write_json_atomic(newer / fmt.MANIFEST, {**manifest, "version": 99})
    fmt.write_marker(newer, {fmt.MANIFEST: digest})
    result = cli_main("ckpt", "verify", str(newer), check=False)
    assert result.returncode == 1 and "newer" in result.stdout
    (newer / fmt.MARKER).unlink()
    assert "completion marker" in cli_main("ckpt", "verify", str(newer), check=False).stdout


# --- the checkpointer on its own (single process) ----------------------------------

def small_state(seed: int = 0) -> tuple[list[Rect], RunRecord]:
    cfg = RecipeConfig()
    tensor = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed))
    state = RunRecord(step=1, layout=recipe_layout(cfg), recipe=to_dict(cfg), consumed_samples=0,
                     optimizer_steps=1)
    return [Rect("model/w", (64, 32), (0, 0), tensor)], state


def test_save_thread_works_on_the_trainers_device(tmp_path, monkeypatch):
    """The async save thread makes the trainer's device current before
    anything else (a new thread would start on GPU 0); the loop thread's own
    device is left alone."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda device: calls.append((threading.current_thread().name, device)))
    ckpt = Checkpointer(tmp_path, "zarr", group=None, asynchronous=True, keep=1,
                        events=EventLog(tmp_path), device=torch.device("cuda", 1))
    ckpt.save(*small_state(), rank_state={})
    ckpt.close()
    assert calls == [("ckpt-save_0", torch.device("cuda", 1))]
    assert (tmp_path / "step_0000001" / fmt.MARKER).exists()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_blocking_seconds_is_what_the_loop_waits_for(tmp_path, asynchronous):
    """On storage that takes a second per write, a synchronous save holds
    the loop for all of it; an async save only for the call and, at the
    loop's next optimizer step (here at once), the staging copy."""
    ckpt = Checkpointer(tmp_path, "zarr", group=None, asynchronous=asynchronous, keep=1,
                        events=EventLog(tmp_path), device=torch.device("cpu"))
    write = ckpt.backend.write
    loop_went_on = threading.Event()

    def slow_write(*args):
        # An async save's write starts only once the loop is past its update,
        # so a loop woken late on a loaded machine cannot overlap the write.
        if asynchronous:
            loop_went_on.wait(timeout=10)
        time.sleep(1.0)
        return write(*args)

    ckpt.backend.write = slow_write
    ckpt.save(*small_state(), rank_state={})
    ckpt.before_update()
    loop_went_on.set()
    ckpt.close()
    saved = next(e for e in read_events(tmp_path) if e["event"] == "checkpoint_saved")
    assert saved["seconds"] >= 1.0
    if asynchronous:
        # A lower bound, not a share of the total: the write's second is in
        # the save's time and none of it in the loop's, however slow the
        # call and the staging copy were.
        assert saved["seconds"] - saved["blocking_seconds"] >= 1.0, saved
    else:
        assert saved["blocking_seconds"] == saved["seconds"]


def test_async_save_is_reported_at_its_commit(tmp_path):
    """The save thread does not wait for the loop to report its stall: a
    loop still busy when the save commits will not wait for it at all, and
    the event is out by the time the save is."""
    ckpt = Checkpointer(tmp_path, "zarr", group=None, asynchronous=True, keep=1,
                        events=EventLog(tmp_path), device=torch.device("cpu"))
    started = time.perf_counter()
    ckpt.save(*small_state(), rank_state={})
    ckpt.pending.result()  # committed; the loop has not reached its next update
    # A save thread that waited for the loop (it once polled for up to 10 s)
    # would still be waiting: this 8 KB save takes milliseconds.
    assert time.perf_counter() - started < 5.0
    saved = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_saved"]
    assert len(saved) == 1 and saved[0]["blocking_seconds"] < saved[0]["seconds"]
    ckpt.close()
    assert [e["event"] for e in read_events(tmp_path)] == ["checkpoint_saved"]


def test_manifests_with_the_retired_lr_schedule_still_load():
    """`lr_schedule` is no longer written (nothing read it); a manifest that
    has it still reads, and it is not carried into new ones."""
    _, state = small_state()
    old = {**state.to_manifest(), "lr_schedule": {"lr": 0.001, "total_steps": 10},
           "watchdog": {"budgets": {}}}
    read = RunRecord.from_manifest(old)
    assert read == RunRecord(**{**vars(state), "extra": {"watchdog": {"budgets": {}}}})
    assert "lr_schedule" not in read.to_manifest()


def test_dcp_metadata_cannot_run_code(tmp_path):
    """A .metadata pickle that would call os.system is refused, not executed."""
    from megaresil.checkpoint.backends.dcp_read import SafeReader

    class Evil:
        def __reduce__(self):
            return (shutil.rmtree, (str(tmp_path / "victim"),))

    (tmp_path / "victim").mkdir()
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(fmt.CheckpointError, match="refusing"):
        SafeReader(str(tmp_path / "dcp")).read_metadata()
    assert (tmp_path / "victim").exists()


@pytest.mark.parametrize("name", ["FileSystemWriter", "Tensor", "Path"])
def test_dcp_metadata_admits_only_metadata_classes(tmp_path, name):
    """Names in filesystem.py's namespace that are not metadata (a writer, a
    tensor, a path class) are refused, while a real DCP save still loads."""
    import torch.distributed.checkpoint as dcp
    from megaresil.checkpoint.backends.dcp_read import SafeReader

    saved = tmp_path / "real"
    dcp.save({"w": torch.ones(2, 3, dtype=torch.bfloat16), "n": {"x": 1}},
             storage_writer=dcp.FileSystemWriter(saved), no_dist=True)
    assert set(SafeReader(str(saved)).read_metadata().state_dict_metadata) == {"w", "n.x"}
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    # A call of filesystem.NAME() with no arguments, as that module names it.
    call = f"ctorch.distributed.checkpoint.filesystem\n{name}\n)R.".encode()
    (crafted / ".metadata").write_bytes(call)
    with pytest.raises(fmt.CheckpointError, match="refusing to load"):
        SafeReader(str(crafted)).read_metadata()


def test_dcp_chunk_regions_read_into_targets(tmp_path):
    """Regions of torch.save'd chunks (as DCP lays them out, one after another
    in a file) land in their targets: whole rows straight from the file,
    column slices through a row buffer, bf16 and 0-d tensors, and a chunk
    saved transposed (not row-major) by the torch.load fallback."""
    from megaresil.checkpoint.backends.dcp_read import narrowed, read_region

    chunks = {"rows": torch.randn(6, 5), "bf16": torch.randn(4, 3).to(torch.bfloat16),
              "scalar": torch.tensor(3.5), "transposed": torch.randn(5, 6).t()}
    where = {}
    with open(tmp_path / "chunks.distcp", "wb") as f:
        for name, tensor in chunks.items():
            start = f.tell()
            torch.save(tensor, f)
            where[name] = (start, f.tell() - start)
    regions = {"rows": [((0, 0), (6, 5)), ((2, 0), (3, 5)), ((1, 2), (4, 2))],
               "bf16": [((1, 0), (2, 3)), ((0, 1), (4, 1))], "scalar": [((), ())],
               "transposed": [((1, 0), (2, 5)), ((0, 3), (6, 2))]}
    with open(tmp_path / "chunks.distcp", "rb") as f:
        for name, wanted in regions.items():
            for offsets, lengths in wanted:
                target = torch.zeros(lengths, dtype=chunks[name].dtype)
                read_region(f, *where[name], offsets, lengths, target)
                assert torch.equal(target, narrowed(chunks[name], offsets, lengths)), (name, offsets)
        wide = torch.zeros(6, 8)  # a column block of a wider target: not contiguous
        read_region(f, *where["rows"], (0, 0), (6, 5), wide[:, 2:7])
        assert torch.equal(wide[:, 2:7], chunks["rows"]) and not wide[:, :2].any()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dist_write_and_read_regions(tmp_path):
    """One writer's torch_dist files: a large chunk page-aligned, small ones
    packed; plain dcp.load and our reader both get the values back, and our
    reader fills other rectangles (row and column blocks) of the tensors."""
    import torch.distributed.checkpoint as dcp

    from megaresil.checkpoint.backends import get_backend

    big = torch.randn(512, 600)  # 1.2 MB: aligned
    small = torch.randn(8, 6).to(torch.bfloat16)
    backend = get_backend("torch_dist")
    backend.prepare(tmp_path)
    done = backend.write(tmp_path, [Rect("big", (1024, 600), (512, 0), big),
                                    Rect("small", (8, 12), (0, 6), small)], 0)
    done.durable()
    backend.finish(tmp_path, [done.note])
    chunk_file = next((tmp_path / "dcp").glob("*.distcp"))
    assert big.numpy().tobytes() in chunk_file.read_bytes()
    offset = chunk_file.read_bytes().index(big.numpy().tobytes())
    assert offset % 4096 == 0
    plain = {"big": torch.zeros(1024, 600), "small": torch.zeros(8, 12, dtype=torch.bfloat16)}
    dcp.load(plain, storage_reader=dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    assert torch.equal(plain["big"][512:], big) and torch.equal(plain["small"][:, 6:], small)
    rows = Rect("big", (1024, 600), (700, 0), torch.zeros(100, 600))
    block = Rect("big", (1024, 600), (600, 250), torch.zeros(300, 100))
    cols = Rect("small", (8, 12), (2, 8), torch.zeros(4, 3, dtype=torch.bfloat16))
    backend.read(tmp_path, {}, [rows, block, cols])
    assert torch.equal(rows.tensor, big[188:288]) and torch.equal(block.tensor, big[88:388, 250:350])
    assert torch.equal(cols.tensor, small[2:6, 2:5])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dist_starts_writeback_while_writing(tmp_path, monkeypatch):
    """A large write hands its pages to the disk as it goes: whole pages,
    in order, never past what was written, at most 16 MiB behind; the
    checkpoint still reads back exactly."""
    import os

    from megaresil.checkpoint.backends import get_backend

    started = []
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, offset, length, advice: started.append(
                            (os.fstat(fd).st_size, offset, length, advice)), raising=False)
    tensors = [torch.randn(1024, 1024 + i) for i in range(12)]  # ~50 MB, odd sizes
    rects = [Rect(f"w{i}", tuple(t.shape), (0, 0), t) for i, t in enumerate(tensors)]
    backend = get_backend("torch_dist")
    backend.prepare(tmp_path)
    done = backend.write(tmp_path, rects, 0)
    done.durable()
    backend.finish(tmp_path, [done.note])
    file_size = next((tmp_path / "dcp").glob("*.distcp")).stat().st_size
    assert len(started) >= 2
    covered = 0
    for size_then, offset, length, advice in started:
        assert advice == os.POSIX_FADV_DONTNEED and offset == covered
        assert offset % 4096 == 0 and length % 4096 == 0 and offset + length <= size_then
        covered += length
    assert file_size - covered < 16 << 20
    targets = [Rect(r.key, r.global_shape, r.offset, torch.zeros_like(r.tensor)) for r in rects]
    backend.read(tmp_path, {}, targets)
    assert all(torch.equal(t.tensor, r.tensor) for t, r in zip(targets, rects))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_chunk_layout_reads_only_what_is_prefetched(tmp_path):
    """Reading a chunk's layout touches only its head and tail windows, the
    ones prefetch_layouts asks the kernel for, in the chunks our writer
    lays out (large page-aligned, small packed)."""
    from megaresil.checkpoint.backends import get_backend
    from megaresil.checkpoint.backends.dcp_read import (LAYOUT_HEAD, LAYOUT_TAIL, FileSlice,
                                                        chunk_layout)

    class Recording:
        def __init__(self, file):
            self.file, self.reads = file, []

        def seek(self, position, whence=0):
            return self.file.seek(position, whence)

        def readinto(self, buffer):
            start = self.file.tell()
            got = self.file.readinto(buffer)
            self.reads.append((start, got))
            return got

    rects = [Rect("big", (600, 800), (0, 0), torch.randn(600, 800)),
             Rect("small", (3, 5), (0, 0), torch.randn(3, 5).to(torch.bfloat16))]
    backend = get_backend("torch_dist")
    backend.prepare(tmp_path)
    done = backend.write(tmp_path, rects, 0)
    done.durable()
    with open(next((tmp_path / "dcp").glob("*.distcp")), "rb") as f:
        for result in done.note[1]:
            start, length = result.storage_data.offset, result.storage_data.length
            file = Recording(f)
            saved, record = chunk_layout(FileSlice(file, start, length))
            assert record is not None and record[1] == saved.nbytes
            for at, n in file.reads:
                assert start <= at and at + n <= start + min(length, LAYOUT_HEAD) or \
                    start + length - LAYOUT_TAIL <= at and at + n <= start + length, (at, n)


def test_manifest_names_cannot_escape(tmp_path):
    with pytest.raises(fmt.CheckpointError, match="outside"):
        fmt.inside(tmp_path, "../../etc/passwd")


@pytest.mark.slow
def test_exit_and_rerun_through_the_cli(cli, tmp_path):
    """The contract's workflow: the same command with train.exit_at_step=K,
    then again without it, continues bit for bit; each process of the job
    writes its own shards (pp=2) and the asynchronous save is committed
    before the exit. At tp=2 x pp=2 x dp=2 (8 processes: three times the
    start-up) the bit-exact resume is test_resume_is_bit_identical's."""
    opts = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=2", "parallel.dp=1",
            "train.steps=6", "train.eval_batches=0",
            "checkpoint.backend=zarr", "checkpoint.async=true", *QUIET]
    cli("train", *opts, f"run.dir={tmp_path / 'straight'}")
    exited = cli("train", *opts, f"run.dir={tmp_path / 'resumed'}", "train.exit_at_step=3")
    assert sorted(losses(tmp_path / "resumed")) == [1, 2, 3]
    # It says where it stopped and how to go on, and ends its bookkeeping.
    assert ("stopped at train.exit_at_step=3, saved; the same command without "
            "train.exit_at_step continues") in exited.stderr
    assert (tmp_path / "resumed" / "goodput.json").exists()
    cli("train", *opts, f"run.dir={tmp_path / 'resumed'}")
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert [resumed[s] for s in (4, 5, 6)] == [straight[s] for s in (4, 5, 6)]
