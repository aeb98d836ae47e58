"""Seeing a run: the FLOPs formula and MFU, the peak probe's cache, goodput's
accounting, straggler scoring, the trackers (W&B and MLflow offline) and the
report's panels. Unit tests on small records; the end-to-end run is at the end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megaresil.config import ConfigError, LoggingConfig, load_recipe
from megaresil.model.gpt import GPT
from megaresil.model.layers import ffn_size
from megaresil.observe import flops, peak
from megaresil.observe.goodput import compute_goodput
from megaresil.observe.report import (MOE_PANEL, PANELS, Run, broken_at_launches, event_step,
                                      expert_load, summary_rows, write_report)
from megaresil.observe.sections import SectionTime
from megaresil.resilience.stragglers import StragglerDetector, judge
from megaresil.train.metrics import MetricsLog, StepFigures, console_line

from tests.harness.cli import ROOT
from tests.harness.run_records import assert_goodput_adds_up

TINY = str(ROOT / "recipes/gpt-tiny.yaml")
MOE = str(ROOT / "recipes/moe-tiny.yaml")


def test_flops_of_gpt_tiny_equal_the_stated_formula():
    cfg = load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1"])
    L, C, T, V, F = 4, 192, 128, 4096, 4 * 192  # gpt-tiny: layers, width, seq, vocab, ffn
    n = L * (C * 3 * C + C * C + 2 * C * F) + C * V
    assert flops.matmul_parameters(cfg.model) == n
    assert flops.flops_per_sample(cfg) == T * (6 * n + 12 * L * T * C)


def test_a_sliding_window_shorter_than_the_sequence_bounds_the_attention_flops():
    base = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "model.flavour=mistral"]
    L, C, T = 4, 192, 128  # gpt-tiny: layers, width, seq
    full = flops.flops_per_token(load_recipe(TINY, base).model, T)
    for window, keys in ((32, 32), (T, T), (1000, T)):
        cfg = load_recipe(TINY, [*base, f"model.sliding_window={window}"]).model
        assert full - flops.flops_per_token(cfg, T) == 12 * L * (T - keys) * C


@pytest.mark.parametrize("overrides", [[], ["model.flavour=llama", "model.num_kv_heads=2"]])
def test_matmul_parameters_are_the_models_matrices(overrides):
    """N counts what the built model multiplies by: every 2-D weight but the
    lookups (positions; the token table unless it is also the head)."""
    cfg = load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", *overrides])
    model = GPT(cfg.model)
    lookups = {"embed.positions.weight"} | ({"embed.tokens.weight"} if not model.tied else set())
    counted = sum(p.numel() for name, p in model.named_parameters()
                  if p.dim() == 2 and name not in lookups)
    assert flops.matmul_parameters(cfg.model) == counted


def test_a_layer_with_experts_counts_its_active_parameters():
    """Per token: top_k routed experts, the shared expert and the router;
    moe-tiny's first layer is dense."""
    cfg = load_recipe(MOE, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
                            "model.moe.shared_expert_hidden_size=64"])
    L, C, V, E, k, Fe, Fs = 4, 128, 4096, 8, 2, 128, 64  # moe-tiny, a shared expert of 64
    attention = C * (4 + 2 * 2) * (C // 4) + C * C  # 4 heads, 2 kv heads
    dense = 3 * C * ffn_size(cfg.model)
    active = k * 3 * C * Fe + 3 * C * Fs + E * C
    assert flops.matmul_parameters(cfg.model) == L * attention + dense + (L - 1) * active + C * V
    model = GPT(cfg.model)
    held = {name: p.numel() for name, p in model.named_parameters()
            if p.dim() >= 2 and (model.tied or name != "embed.tokens.weight")}
    routed = sum(n for name, n in held.items() if ".experts." in name)
    assert flops.matmul_parameters(cfg.model) == sum(held.values()) - routed + routed * k // E


def test_step_figures_are_tflops_per_device_over_the_peak():
    """Of the batch the step trained: a ramp's half batch is half the FLOPs."""
    figures = StepFigures(flops_per_sample=375_000_000_000, devices=4, peak_tflops=2.0,
                          device=torch.device("cpu"))
    out = figures.of(step_time_s=0.5, global_batch=16)
    assert out["tflops"] == 6e12 / 0.5 / 4 / 1e12 == 3.0
    assert out["mfu"] == 1.5
    assert figures.of(step_time_s=0.5, global_batch=8)["tflops"] == 1.5
    assert out["mem_peak_mb"] > 10  # this process's peak resident set


def test_peak_probe_runs_once_per_kind_of_device(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(peak, "probe_tflops", lambda d, t: calls.append(t) or 1.25)
    cache = tmp_path / "peak.json"
    cpu = torch.device("cpu")
    assert peak.cached_peak_tflops(cache, cpu, torch.float32) == 1.25
    assert peak.cached_peak_tflops(cache, cpu, torch.float32) == 1.25
    assert peak.cached_peak_tflops(cache, cpu, torch.bfloat16) == 1.25
    assert calls == [torch.float32, torch.bfloat16]
    assert len(json.loads(cache.read_text())) == 2


def test_the_probe_measures_a_positive_rate_without_touching_the_rng():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    assert peak.probe_tflops(torch.device("cpu"), torch.float32, seconds=0.05, size=64) > 0
    assert torch.equal(torch.get_rng_state(), before)


def step(n: int, t: float, seconds: float = 1.0, **extra) -> dict:
    return {"step": n, "loss": 1.0, "time": t, "step_time_s": seconds, **extra}


def test_goodput_puts_every_second_in_one_bucket():
    """Launch at 0; steps 1-3 end at 10, 11, 12; a save blocks 0.5 s after step
    2 (step 3 takes 0.4 s after it); a failure is detected at 14; step 3 is
    redone, ending at 20; step 4 at 21; an eval of 0.25 s; the run finishes
    at 22."""
    events = [{"time": 1.0, "event": "generation_started", "launched_at": 0.0},
              {"time": 11.6, "event": "checkpoint_saved", "blocking_seconds": 0.5},
              {"time": 14.0, "event": "worker_error"},
              {"time": 14.5, "event": "restart", "kind": "in_process"},
              {"time": 22.0, "event": "run_finished"}]
    metrics = [step(1, 10.0), step(2, 11.0), step(3, 12.0, 0.4), step(3, 20.0), step(4, 21.0),
               {"step": 4, "eval_loss": 1.0, "time": 21.5, "eval_time_s": 0.25}]
    g = compute_goodput(events, metrics)
    assert g["wall_s"] == 22.0
    assert g["startup_s"] == 10.0  # launch -> end of step 1 (its warm-up)
    assert g["restarts_s"] == 6.0  # detection 14 -> end of the redone step 3 at 20
    assert g["failed_s"] == 2.0  # last step (12) -> detection (14)
    assert g["recomputed_s"] == 0.4  # the first step 3
    assert g["productive_s"] == 2.0  # steps 2 and 4
    assert g["checkpoint_s"] == 0.5 and g["eval_s"] == 0.25
    assert g["other_s"] == pytest.approx(22.0 - 10 - 6 - 2 - 0.4 - 2 - 0.5 - 0.25)
    assert g["goodput"] == 2.0 / 22.0
    assert g["interruptions"] == 1 and g["recomputed_steps"] == 1
    assert_goodput_adds_up(g)


def section_table(cpu: dict[int, dict[str, float]], wall_extra: dict[int, float]) -> list[dict]:
    return [{"steps": 2, "first": 3, "mem_peak_mb": 100.0 + r,
             "sections": {s: {"cpu_s": c, "wall_s": c + wall_extra.get(r, 0.0)}
                          for s, c in cpu[r].items()}} for r in sorted(cpu)]


def test_the_slow_rank_is_named_not_the_ranks_waiting_for_it():
    # Rank 2 computes 0.3 s more in data; the others wait for it in
    # forward_backward (wall time) without computing (CPU time).
    cpu = {r: {"data": 0.01, "forward_backward": 0.1} for r in range(4)}
    cpu[2]["data"] = 0.31
    found = judge(section_table(cpu, {0: 0.3, 1: 0.3, 3: 0.3}), pp=1, threshold=1.5)
    assert found["slow"] == [(2, "data", pytest.approx(31.0))]
    assert found["scores"][2] == pytest.approx(0.11 / 0.41)
    assert all(found["scores"][r] == 1.0 for r in (0, 1, 3))


def test_a_rank_that_waited_is_not_named_for_the_cpu_its_wait_cost():
    # From a CI run of the slow-rank drill at dp=2: rank 1 sleeps 0.3 s in
    # data, rank 0 waits for it in the optimizer's all-reduce, polling: 8 ms
    # more CPU there than rank 1, 1.5x its peer's, over 0.31 s of waiting.
    table = [{"steps": 2, "first": 7, "mem_peak_mb": 100.0, "sections": {
                 "optimizer": {"cpu_s": 0.024124, "wall_s": 0.332543},
                 "data": {"cpu_s": 0.000281, "wall_s": 0.000281},
                 "forward_backward": {"cpu_s": 0.071249, "wall_s": 0.072343}}},
             {"steps": 2, "first": 7, "mem_peak_mb": 100.0, "sections": {
                 "optimizer": {"cpu_s": 0.015979, "wall_s": 0.035566},
                 "data": {"cpu_s": 0.296587, "wall_s": 0.300623},
                 "forward_backward": {"cpu_s": 0.069199, "wall_s": 0.069196}}}]
    assert [(r, s) for r, s, _ in judge(table, pp=1, threshold=1.5)["slow"]] == [(1, "data")]


def test_a_save_is_uneven_by_design_not_a_straggler():
    cpu = {r: {"checkpoint": 0.05 if r else 0.5} for r in range(4)}  # rank 0 commits
    assert judge(section_table(cpu, {}), pp=1, threshold=1.5)["slow"] == []


def test_two_ranks_compare_with_each_other():
    cpu = {0: {"data": 0.01, "forward_backward": 0.1}, 1: {"data": 0.2, "forward_backward": 0.1}}
    assert [(r, s) for r, s, _ in judge(section_table(cpu, {}), 1, 1.5)["slow"]] == [(1, "data")]


def test_pipeline_stages_are_compared_within_their_stage():
    # pp=2 over 4 ranks: the last stage (ranks 2, 3) does twice the work by design.
    cpu = {r: {"forward_backward": 0.1 if r < 2 else 0.2} for r in range(4)}
    assert judge(section_table(cpu, {}), pp=2, threshold=1.5)["slow"] == []
    assert judge(section_table(cpu, {}), pp=1, threshold=1.5)["slow"] != []


class Events:
    def __init__(self):
        self.emitted = []

    def emit(self, event, **fields):
        self.emitted.append({"event": event, **fields})


def test_straggler_detected_after_consecutive_slow_windows_once(tmp_path):
    events = Events()
    cfg = LoggingConfig(straggler_interval=2, straggler_windows=2)
    detector = StragglerDetector(cfg, rank=0, run_dir=tmp_path, events=events)
    cpu = {0: {"data": 0.01}, 1: {"data": 0.01}, 2: {"data": 0.5}}
    for window in range(4):
        detector.report(2 * window + 2, section_table(cpu, {}))
    detected = [e for e in events.emitted if e["event"] == "straggler_detected"]
    assert [(e["rank"], e["section"], e["window"]) for e in detected] == [(2, "data", [3, 4])]
    lines = (tmp_path / "stragglers.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["mem_peak_mb"]["2"] == 102.0


def test_a_single_process_window_is_scored_alone(tmp_path):
    """Without a process group the window is this rank's: no collective."""
    detector = StragglerDetector(LoggingConfig(straggler_interval=2), rank=0, run_dir=tmp_path,
                                 events=Events())
    for s in (1, 2, 3, 4):
        detector.step_done(s, {"data": SectionTime(0.1, 0.1)}, warm_up=s == 1)
    lines = [json.loads(x) for x in (tmp_path / "stragglers.jsonl").read_text().splitlines()]
    assert [(w["window"], w["steps"]) for w in lines] == [([2, 2], 1), ([3, 4], 2)]


def fake_run(path: Path, *, restart: bool, seed: float) -> Path:
    """A small run directory as training writes it (two ranks, a restart)."""
    path.mkdir(parents=True)
    t0 = 1000.0
    metrics, events = [], [{"time": t0 + 1, "event": "generation_started", "launched_at": t0}]
    for s in range(1, 9):
        metrics.append(step(s, t0 + 5 + s, 0.8, tokens_per_s=1000 + s, mfu=0.1 + seed,
                            tflops=0.01, mem_peak_mb=300.0, lr=1e-3, grad_norm=1.0,
                            loss=5 - 0.3 * s + seed))
    metrics.append({"step": 8, "eval_loss": 3.0 + seed, "time": t0 + 13.5, "eval_time_s": 0.2})
    if restart:
        events += [{"time": t0 + 9.5, "event": "fault_injected", "step": 5},
                   {"time": t0 + 9.6, "event": "worker_error", "rank": 1, "step": 5},
                   {"time": t0 + 9.7, "event": "restart", "kind": "in_process"},
                   {"time": t0 + 9.8, "event": "straggler_detected", "rank": 1, "step": 4}]
    events.append({"time": t0 + 14, "event": "run_finished", "step": 8})
    windows = [{"window": [w, w + 1], "ratios": {"0": {"data": 1.0}, "1": {"data": 2.0 + w}},
                "scores": {"0": 1.0, "1": 0.4}, "mem_peak_mb": {"0": 300.0, "1": 310.0}}
               for w in (3, 5, 7)]
    for name, rows in (("metrics.jsonl", metrics), ("events.jsonl", events),
                       ("stragglers.jsonl", windows)):
        (path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_renders_every_panel(tmp_path):
    faulted = fake_run(tmp_path / "faulted", restart=True, seed=0.0)
    reference = fake_run(tmp_path / "reference", restart=False, seed=0.01)
    page = write_report(faulted, [reference])
    assert page == faulted / "report" / "index.html"
    for panel in PANELS:
        png = faulted / "report" / f"{panel}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", panel
    text = page.read_text()
    assert text.count('src="data:image/png;base64,') == len(PANELS)
    summary = json.loads((faulted / "report" / "summary.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["faulted", "reference"]
    assert summary["ranks"][1]["worst ratio"] == 9.0 and summary["ranks"][1]["in section"] == "data"
    assert not (faulted / "report" / f"{MOE_PANEL}.png").exists()  # no experts


def test_report_draws_the_expert_load_of_a_mixture_of_experts(tmp_path):
    run = fake_run(tmp_path / "moe", restart=False, seed=0.0)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    steps[0]["moe_load"] = {"1": [6, 2, 0, 0], "3": [2, 2, 2, 2]}
    steps[1]["moe_load"] = {"1": [2, 2, 4, 0], "3": [1, 3, 2, 2]}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert expert_load(Run.read(run)) == (["1", "3"], [[2.0, 1.0, 1.0, 0.0],
                                                       [0.75, 1.25, 1.0, 1.0]])
    write_report(run)
    assert (run / "report" / f"{MOE_PANEL}.png").read_bytes()[:4] == b"\x89PNG"
    assert (run / "report" / "index.html").read_text().count("data:image/png") == len(PANELS) + 1


def test_report_cli_writes_where_told(tmp_path, capsys):
    from megaresil.cli import main

    run = fake_run(tmp_path / "run", restart=False, seed=0.0)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "index.html").exists() and "wrote" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "nothing")]) == 1


def test_console_line_has_every_figure():
    line = console_line({"step": 10, "loss": 3.25, "lr": 1e-3, "grad_norm": 0.5,
                         "tokens_per_s": 12345.0, "mfu": 0.0123, "step_time_s": 0.25}, 100)
    assert line == ("step 10/100 | loss 3.2500 | lr 1.00e-03 | grad norm 0.500 | "
                    "12,345 tok/s | MFU 1.23% | step 0.250 s")


def test_a_mixture_of_experts_console_line_shows_its_balance():
    line = console_line({"step": 10, "loss": 3.25, "lr": 1e-3, "grad_norm": 0.5,
                         "tokens_per_s": 12345.0, "step_time_s": 0.25, "moe_imbalance": 1.3449},
                        100)
    assert line.endswith("| step 0.250 s | moe max/mean 1.34")


def test_trackers_continue_the_same_run_after_a_restart(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the `test` extra installs wandb")
    mlflow = pytest.importorskip("mlflow", reason="the `test` extra installs mlflow-skinny")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 prefers a database
    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = f"file://{tmp_path}/mlruns"
    cfg = load_recipe(TINY, ["logging.tensorboard=false", "logging.progress=false",
                             "logging.wandb.enabled=true", "logging.wandb.mode=offline",
                             "logging.mlflow.enabled=true", f"logging.mlflow.tracking_uri={uri}",
                             "logging.mlflow.experiment=observe", f"run.dir={tmp_path}"])
    figures = StepFigures(10**12, 1, 1.0, torch.device("cpu"))
    for generation in range(2):  # a restart builds the log again
        log = MetricsLog(tmp_path, cfg, figures, start_step=2 * generation)
        for s in (1, 2):
            log.write({"step": 2 * generation + s, "loss": 1.0 / s, "lr": 1e-3, "grad_norm": 1.0,
                       "tokens_per_s": 1.0, "step_time_s": 0.5, "global_batch_size": 1,
                       "time": 1.0})
        log.close()
    run_id = (tmp_path / "mlflow_run_id").read_text()
    history = mlflow.MlflowClient(uri).get_metric_history(run_id, "mfu")
    assert [(m.step, m.value) for m in history] == [(s, 2.0) for s in (1, 2, 3, 4)]
    wandb_id = (tmp_path / "wandb_run_id").read_text()
    offline = sorted(p.name for p in (tmp_path / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(wandb_id) for name in offline)


def test_a_tracker_that_is_not_installed_is_an_error_naming_the_fix(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.delitem(__import__("sys").modules, "wandb", raising=False)
    cfg = load_recipe(TINY, ["logging.tensorboard=false", "logging.wandb.enabled=true"])
    with pytest.raises(ConfigError, match="pip install wandb"):
        MetricsLog(tmp_path, cfg, StepFigures(1, 1, 1.0, torch.device("cpu")), start_step=0)


def test_bad_observe_keys_are_refused():
    with pytest.raises(ConfigError, match="logging.wandb.mode"):
        load_recipe(TINY, ["logging.wandb.mode=sometimes"])
    with pytest.raises(ConfigError, match="logging.straggler_threshold"):
        load_recipe(TINY, ["logging.straggler_threshold=1"])


@pytest.mark.slow
def test_a_run_records_its_figures_goodput_and_profile(cli, tmp_path):
    """One process, 6 steps: every step's figures equal the formula, the
    console prints a line every log_interval steps, goodput.json and the
    run_finished event agree, and the profiled steps left a trace."""
    result = cli("train", TINY, "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
                 "train.steps=6", "data.seq_len=32", "train.global_batch_size=8",
                 "train.eval_batches=1", "checkpoint.interval=3", "logging.progress=false",
                 "logging.tensorboard=false", "logging.log_interval=2", "logging.peak_tflops=0.5",
                 "profile.enabled=true", "profile.start_step=2", "profile.steps=2",
                 f"run.dir={tmp_path}")
    cfg = load_recipe(TINY, ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
                             "data.seq_len=32", "train.global_batch_size=8"])
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert r["global_batch_size"] == 8
        assert r["tflops"] == flops.flops_per_sample(cfg) * 8 / r["step_time_s"] / 1 / 1e12
        assert r["mfu"] == r["tflops"] / 0.5
        sections = sum(r[f"time_{s}_s"] for s in ("data", "forward_backward", "optimizer"))
        assert 0 < sections <= r["step_time_s"]
        assert r["mem_peak_mb"] > 50
    assert steps[3]["time_checkpoint_s"] > 0  # the save after step 3, waited for before step 4
    printed = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in printed if "|" in line] == ["2/6", "4/6", "6/6"]
    goodput = json.loads((tmp_path / "goodput.json").read_text())
    finished = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()
                if '"run_finished"' in x][0]
    assert finished["goodput"] == goodput and 0 < goodput["goodput"] < 1
    assert_goodput_adds_up(goodput)
    assert goodput["productive_s"] == pytest.approx(sum(r["step_time_s"] for r in steps[1:]))
    trace = json.loads((tmp_path / "profile" / "rank0.steps2-3.pt.trace.json").read_text())
    assert any("aten::" in e.get("name", "") for e in trace["traceEvents"])


@pytest.mark.parametrize("stop", ["interrupted", "preempted", "exit_at_step"])
def test_goodput_books_an_intended_stop_as_no_failure_and_its_pause_as_idle(stop):
    """Job 1 launched at 0: steps 1-2 end at 10, 11; it stops as intended (a
    save of step 2 ends at 12, then Ctrl-C, a preemption or exit_at_step).
    The user reruns at 100; step 3 ends at 105, step 4 at 106."""
    events = [{"time": 1.0, "event": "generation_started", "launched_at": 0.0},
              {"time": 12.0, "event": "checkpoint_saved", "step": 2, "blocking_seconds": 1.0},
              {"time": 101.0, "event": "generation_started", "launched_at": 100.0},
              {"time": 106.5, "event": "run_finished"}]
    if stop != "exit_at_step":  # (a run written before the `exited` event: only the save)
        events.insert(2, {"time": 12.0, "event": stop, "step": 2})
    metrics = [step(1, 10.0), step(2, 11.0), step(3, 105.0), step(4, 106.0)]
    g = compute_goodput(events, metrics)
    assert g["idle_s"] == 88.0  # the stop at 12 -> the rerun's launch at 100
    assert g["startup_s"] == 15.0  # both jobs' own starts: 0 -> 10 and 100 -> 105
    assert g["restarts_s"] == 0.0 and g["failed_s"] == 0.0 and g["interruptions"] == 0
    assert g["checkpoint_s"] == 1.0 and g["other_s"] == 0.5  # the end: 106 -> 106.5
    assert g["productive_s"] == 2.0  # steps 2 and 4 (1 and 3 are warm-ups)
    assert g["goodput"] == pytest.approx(2.0 / (106.5 - 88.0))


def job(launched: float, step: int, saved: float, blocking: float, stop: str,
        stopped: float) -> list[dict]:
    """The events of one job: its launch, the save of its last step, its stop."""
    return [{"time": launched + 1, "event": "generation_started", "launched_at": launched},
            {"time": saved, "event": "checkpoint_saved", "step": step,
             "blocking_seconds": blocking},
            {"time": stopped, "event": stop, "step": step}]


def test_goodput_of_two_ctrl_cs_an_exit_and_a_rerun_of_the_finished_run():
    """The issue's run with no fault: exit_at_step at 2 (its save ends at 12),
    Ctrl-C in step 4 (saved at 31), Ctrl-C in step 6 (saved at 52), the rest
    to step 8 (finished at 71), then the same command once more (launched at
    80, finished at 84 without a step). Each job's start is start-up, each
    pause idle; nothing failed, nothing restarted."""
    events = (job(0.0, 2, 12.0, 1.0, "exited", 12.1) + job(20.0, 4, 31.0, 1.0, "interrupted", 31.2)
              + job(40.0, 6, 52.0, 1.5, "interrupted", 52.0)
              + job(60.0, 8, 70.5, 0.5, "run_finished", 71.0)
              + [{"time": 83.0, "event": "generation_started", "launched_at": 80.0},
                 {"time": 84.0, "event": "run_finished", "step": 8}])
    metrics = [step(1, 10.0), step(2, 11.0), step(3, 29.0), step(4, 30.0), step(5, 49.0),
               step(6, 50.5), step(7, 69.0), step(8, 70.0)]
    g = compute_goodput(events, metrics)
    assert_goodput_adds_up(g)
    assert g["interruptions"] == 0 and g["restarts_s"] == 0.0 and g["failed_s"] == 0.0
    assert g["startup_s"] == 10.0 + 9.0 + 9.0 + 9.0 + 4.0  # each launch to its first step
    assert g["idle_s"] == pytest.approx(7.9 + 8.8 + 8.0 + 9.0)  # each stop to the next launch
    assert g["checkpoint_s"] == 4.0 and g["productive_s"] == 4.0


def test_no_goodput_bucket_is_negative_where_events_overlap():
    """What the records of real runs hold: a failure before the first step
    (its restart is not start-up as well); an async save's 2 s, 1.5 of them a
    wait inside the next step's own time; an eval a pipeline's last stage
    wrote after its run_finished."""
    events = [{"time": 1.0, "event": "generation_started", "launched_at": 0.0},
              {"time": 4.0, "event": "worker_error", "rank": 1},
              {"time": 5.0, "event": "restart", "kind": "in_process"},
              {"time": 12.0, "event": "checkpoint_saved", "step": 2, "blocking_seconds": 2.0},
              {"time": 14.0, "event": "worker_error", "rank": 0},
              {"time": 20.0, "event": "run_finished", "step": 3}]
    metrics = [step(1, 10.0), step(2, 11.0), step(3, 12.6, 1.1), step(3, 19.9),
               {"step": 3, "eval_loss": 1.0, "time": 20.2, "eval_time_s": 0.5}]
    g = compute_goodput(events, metrics)
    assert_goodput_adds_up(g)
    assert g["interruptions"] == 2
    assert g["startup_s"] == 4.0 and g["restarts_s"] == pytest.approx(6.0 + 5.9)
    assert g["checkpoint_s"] == pytest.approx(0.5)  # what the loop waited outside step 3
    assert g["failed_s"] == pytest.approx(1.4) and g["eval_s"] == 0.0


def relaunched_run(path: Path) -> Path:
    """Job 1 (two ranks) runs steps 1-4, fails in step 5, and the user reruns it
    much later at one rank: steps 5-8 (a layout change)."""
    path.mkdir(parents=True)
    t0 = 1000.0
    events = [{"time": t0 + 1, "event": "generation_started", "launched_at": t0},
              {"time": t0 + 9.5, "event": "worker_error", "rank": 1},
              {"time": t0 + 9.6, "event": "straggler_detected", "rank": 1, "window": [3, 4]},
              {"time": t0 + 101, "event": "generation_started", "launched_at": t0 + 100}]
    metrics = [step(s, t0 + 5 + s, 0.8, tokens_per_s=1000.0, mfu=0.25, lr=1e-3, grad_norm=1.0)
               for s in range(1, 5)]
    metrics += [step(s, t0 + 100 + s, 0.8, tokens_per_s=900.0, mfu=0.25, lr=1e-3,
                     grad_norm=1.0) for s in range(5, 9)]
    windows = [{"window": [3, 4], "ratios": {"0": {"data": 1.0}, "1": {"data": 1.5}},
                "scores": {"0": 1.0, "1": 0.5}, "mem_peak_mb": {"0": 1.0, "1": 1.0}},
               {"window": [7, 8], "ratios": {"0": {"data": 1.0}}, "scores": {"0": 1.0},
                "mem_peak_mb": {"0": 1.0}}]
    for name, rows in (("metrics.jsonl", metrics), ("events.jsonl", events),
                       ("stragglers.jsonl", windows)):
        (path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_report_breaks_lines_at_relaunches_and_marks_events_at_their_step(tmp_path):
    run = Run.read(relaunched_run(tmp_path / "run"))
    minutes, rates = broken_at_launches(run, lambda r: r["tokens_per_s"])
    assert len(minutes) == 9 and minutes[4] != minutes[4]  # one NaN between steps 4 and 5
    assert rates[:4] == [1000.0] * 4 and rates[5:] == [900.0] * 4
    error, straggler = (e for e in run.events if e["event"] in ("worker_error",
                                                                  "straggler_detected"))
    assert event_step(error, run.records) == 5  # under way when it failed, not the last step
    assert event_step(straggler, run.records) == 4
    row = summary_rows([run])[0]
    assert row["median MFU %"] == 25.0 and 0 < row["goodput %"] <= 100
    page = write_report(run.path)  # the heat map's blank row after the layout change: a note
    assert page.exists() and (run.path / "report" / "stragglers.png").exists()


def test_every_metrics_row_names_its_generation(tmp_path):
    """A step redone after a restart is told apart by its generation."""
    cfg = load_recipe(TINY, ["logging.tensorboard=false", "logging.progress=false"])
    figures = StepFigures(10**12, 1, 1.0, torch.device("cpu"))
    for generation, steps in ((0, (1, 2)), (1, (2, 3))):  # step 2 redone after a restart
        log = MetricsLog(tmp_path, cfg, figures, start_step=steps[0] - 1, generation=generation)
        for s in steps:
            log.write({"step": s, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0,
                       "tokens_per_s": 1.0, "step_time_s": 0.5, "global_batch_size": 1,
                       "time": 1.0})
        log.write({"step": steps[-1], "eval_loss": 1.0, "time": 1.0})
        log.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["generation"]) for r in rows] == [(1, 0), (2, 0), (2, 0), (2, 1),
                                                            (3, 1), (3, 1)]
