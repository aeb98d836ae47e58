"""Issue 26's console parts, in process: start-up phase lines (fake clock),
the held-out test split, a torch-free `ckpt inspect`, and eval/generate
refusing a model that does not fit one process."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megaresil.checkpoint import format as fmt
from megaresil.config import ConfigError, DataConfig
from megaresil.data.build import build_datasets, build_test_dataset
from megaresil.observe.startup import StartupPhases, describe
from megaresil.resilience.incidents import describe as incident_line
from tests.harness.fake_clock import FakeClock
from tests.unit.test_data_blend import numbered_documents


class Recorder:
    def __init__(self):
        self.emitted = []

    def emit(self, event: str, **fields) -> dict:
        self.emitted.append({"event": event, **fields})
        return self.emitted[-1]


# --- start-up phase lines -------------------------------------------------------------------


def test_a_phase_gets_a_line_only_when_it_passes_the_threshold():
    events, clock = Recorder(), FakeClock(100.0)
    phases = StartupPhases(events, rank=0, clock=clock, threshold=2.0)
    with phases.phase("rendezvous"):
        clock.now += 1.9
    assert events.emitted == []
    with phases.phase("checkpoint load") as load:
        clock.now += 4.0
        load["bytes"] = 2_000_000_000
    assert events.emitted == [{"event": "startup_phase", "phase": "checkpoint load",
                               "seconds": 4.0, "bytes": 2_000_000_000,
                               "bytes_per_s": 500_000_000.0}]
    assert incident_line(events.emitted[0]) == \
        "megaresil: start-up: checkpoint load took 4.0 s (2.000 GB, 0.500 GB/s)"


def test_only_rank_0_reports_and_a_failed_phase_says_nothing():
    events, clock = Recorder(), FakeClock(100.0)
    StartupPhases(events, rank=3, clock=clock, threshold=0.0).finished("rendezvous", 9.0)
    assert events.emitted == []
    phases = StartupPhases(events, rank=0, clock=clock, threshold=0.0)
    with pytest.raises(RuntimeError):
        with phases.phase("data, model and optimizer build"):
            clock.now += 5.0
            raise RuntimeError("the build failed: its own error says so")
    assert events.emitted == []
    phases.finished("rendezvous", 2.5)
    assert describe(events.emitted[0]) == "start-up: rendezvous took 2.5 s"


def test_the_launchers_phases_are_also_said_at_once():
    events, said = Recorder(), []
    StartupPhases(events, 0, threshold=2.0, say=said.append).finished("data preparation", 4.25)
    assert said == ["megaresil: start-up: data preparation took 4.2 s"]
    assert events.emitted[0]["phase"] == "data preparation"


def test_the_threshold_defaults_to_two_seconds_and_the_env_knob_lowers_it(monkeypatch):
    monkeypatch.delenv("MEGARESIL_PHASE_LINE_S", raising=False)
    assert StartupPhases(Recorder(), 0).threshold == 2.0
    monkeypatch.setenv("MEGARESIL_PHASE_LINE_S", "0")
    assert StartupPhases(Recorder(), 0).threshold == 0.0


# --- the test split -------------------------------------------------------------------------


def indexed(**kwargs) -> DataConfig:
    """Data written without a record of its tokenizer: the recipe names one."""
    return DataConfig(source="indexed", seq_len=4, tokenizer="byte", **kwargs)


def tokens_of(dataset) -> set[int]:
    return {int(t) for i in range(dataset.samples_per_epoch) for t in dataset[i][0]}


def test_indexed_test_split_is_the_test_share_or_prefix_test(tmp_path):
    prefix = numbered_documents(tmp_path / "ds", count=100, length=9)
    cfg = indexed(path=str(prefix), split="80,15,5")
    train, valid, _ = build_datasets(cfg, 300, 0)
    test = build_test_dataset(cfg, 300, 0)
    assert tokens_of(test) == set(range(95, 100))
    assert tokens_of(valid) == set(range(80, 95)) and tokens_of(train) == set(range(80))
    with pytest.raises(ConfigError, match="data.split.*no test documents.*969,30,1"):
        build_test_dataset(indexed(path=str(prefix), split="90,10,0"), 300, 0)
    with pytest.raises(ConfigError, match="no .*ds_test and no data.split"):
        build_test_dataset(indexed(path=str(prefix)), 300, 0)
    numbered_documents(tmp_path / "ds_test", count=2, length=9, first_id=250)
    assert tokens_of(build_test_dataset(indexed(path=str(prefix)), 300, 0)) == {250, 251}


def prepared(tmp_path: Path, documents: list[str], **kwargs) -> DataConfig:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n\n".join(documents))
    return DataConfig(source=str(corpus), tokenizer="byte", seq_len=8,
                      cache_dir=str(tmp_path / "cache"), **kwargs)


def text(dataset) -> str:
    """A byte-tokenized dataset's text (its end-of-document ids dropped)."""
    ids = dataset.indexed.tokens()[dataset.start:dataset.end].tolist()
    return bytes(i for i in ids if i < 256).decode()


def test_a_prepared_corpus_halves_its_held_out_part_into_valid_and_test(tmp_path):
    documents = [f"document {d:02d} " * 4 for d in range(40)]
    cfg = prepared(tmp_path, documents, valid_fraction=0.1)  # the last 4 documents held out
    train, valid, info = build_datasets(cfg, 512, 0)
    test = build_test_dataset(cfg, 512, 0)
    assert valid.indexed.prefix == test.indexed.prefix == info.valid_prefix
    assert valid.start == 0 and valid.end == test.start and test.end == valid.indexed.num_tokens
    assert valid.indexed.document_tokens(0, 2) == (valid.start, valid.end)  # documents 36, 37
    assert "document 37" in text(valid) and "document 38" not in text(valid)
    assert "document 38" in text(test) and "document 39" in text(test)
    assert "document 35" in text(train) and "document 36" not in text(train)


def test_a_held_out_part_too_small_to_halve_stays_valid_and_has_no_test(tmp_path):
    cfg = prepared(tmp_path, [f"doc {d} " * 3 for d in range(10)] + ["tiny tiny!!"],
                   valid_fraction=0.05)
    _, valid, info = build_datasets(cfg, 512, 0)
    assert (valid.start, valid.end) == (0, valid.indexed.num_tokens)
    with pytest.raises(ConfigError, match="data.valid_fraction.*too small.*--split valid"):
        build_test_dataset(cfg, 512, 0)


def test_synthetic_test_samples_differ_from_valid(tmp_path):
    cfg = DataConfig(source="synthetic", seq_len=8)
    _, valid, _ = build_datasets(cfg, 64, 0)
    test = build_test_dataset(cfg, 64, 0)
    assert not torch.equal(valid[0][0], test[0][0])


# --- ckpt inspect without torch ---------------------------------------------------------------


def model_checkpoint(root: Path) -> Path:
    """A one-process save of one model tensor at step 3, with the layout a run records."""
    from megaresil.checkpoint.manager import Checkpointer
    from megaresil.checkpoint.sharded import Rect
    from megaresil.checkpoint.state import RunRecord

    layout = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1, "sequence_parallel": False,
              "distributed_optimizer": False, "world_size": 1}
    ckpt = Checkpointer(root, "torch_dist", group=None, asynchronous=False, keep=0,
                        events=Recorder(), device=torch.device("cpu"))
    ckpt.save([Rect("model/w", (4, 3), (0, 0), torch.arange(12.0).view(4, 3))],
              RunRecord(step=3, layout=layout, recipe={"optimizer": {"lr": 0.1}},
                       consumed_samples=24, optimizer_steps=3), rank_state={"seed": 5})
    ckpt.close()
    return root / fmt.step_dir_name(3)


def test_ckpt_inspect_never_imports_torch(tmp_path):
    model_checkpoint(tmp_path / "checkpoints")
    code = ("import sys\nfrom megaresil.cli import main\n"
            f"assert main(['ckpt', 'inspect', {str(tmp_path)!r}]) == 0\n"
            "assert main(['ckpt', 'inspect', '--json', "
            f"{str(tmp_path / 'checkpoints' / 'latest')!r}]) == 0\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "step        3" in result.stdout and "parameters  12" in result.stdout
    assert result.stdout.strip().endswith("torch imported: False"), result.stdout


def test_ckpt_inspects_model_line_shows_the_experts():
    from megaresil.checkpoint.offline.inspect import format_model

    dense = {"flavour": "llama", "num_layers": 4, "moe": {"num_experts": 0, "top_k": 2}}
    assert format_model(dense) == "flavour=llama num_layers=4"
    moe = {**dense, "moe": {"num_experts": 8, "top_k": 2}}
    assert format_model(moe) == "flavour=llama num_layers=4 experts=8 top_k=2"


def test_a_manifest_dtype_is_checked_without_torch():
    assert fmt.region_bytes([3, 4], "bfloat16") == 24
    assert fmt.torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(fmt.CheckpointError, match="unsupported dtype 'complex32'"):
        fmt.region_bytes([1], "complex32")


# --- eval / generate: does the model fit one process? ------------------------------------------


def test_a_model_too_big_for_one_process_is_refused_naming_sizes_and_fix():
    from megaresil.inference import check_fits, model_bytes

    manifest = {"tensors": {
        "model/w": {"global_shape": [1000, 1000], "dtype": "float32", "shards": []},
        "optim/w/exp_avg": {"global_shape": [1000, 1000], "dtype": "float32", "shards": []}}}
    needed = model_bytes(manifest)
    # The weights alone, loaded in fp32 under any precision: the model-only
    # load (inference_model.py) allocates no grad buffer, main copy or optimizer state.
    assert needed == 4_000_000
    check_fits(Path("ck"), needed, needed, torch.device("cpu"), tp=1)
    gpu = torch.device("cuda", 0)
    with pytest.raises(fmt.CheckpointError) as refused:
        check_fits(Path("ck"), 30_000_000_000, 12_500_000_000, gpu, tp=1)
    message = str(refused.value)
    assert "needs about 30.00 GB on one GPU" in message and "cuda has 12.50 GB free" in message
    assert "Fix: spread it over more GPUs with --tp N" in message and "\n" not in message
    check_fits(Path("ck"), 30_000_000_000, 12_500_000_000, gpu, tp=4)  # 7.5 GB on each
    with pytest.raises(fmt.CheckpointError, match="30.00 GB of the cpu's memory \\(4 processes"):
        check_fits(Path("ck"), 30_000_000_000, 12_500_000_000, torch.device("cpu"), tp=4)


# --- a second Ctrl-C in a worker whose main thread is inside C --------------------------------


def test_a_worker_stops_at_the_second_sigint_while_its_main_thread_is_in_c():
    """Under torchrun or srun the terminal's SIGINT reaches the workers. A
    step in C runs no Python signal handler until it returns, so the count
    must come from the wakeup fd's thread, or the second Ctrl-C waits out
    the step."""
    import signal

    # The main thread blocks SIGINT (delivered to the other threads then) and
    # sleeps in libc: as a step in C, it runs no handler until it returns.
    code = ("import ctypes, signal\nfrom megaresil.resilience.preemption import PreemptionFlag\n"
            "flag = PreemptionFlag().install()\nflag.saving_possible = True\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n"
            "print('ready', flush=True)\nctypes.CDLL(None).sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the first one asks for a save at the step's end
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)  # not the 120 s the C call would take
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert "second Ctrl-C: stopping at once, without saving" in proc.stderr.read()


def test_a_hang_on_a_silent_rank_says_it_stopped_beating():
    line = incident_line({"event": "hang_detected", "section": "checkpoint", "step": 4,
                          "waited_s": 2.3, "budget_s": 2.0, "culprit_ranks": [1],
                          "why": "silent", "stack_dump": "runs/a/hangs/generation_0"})
    assert line == ("megaresil: hang detected in checkpoint at step 4: rank(s) [1] stopped "
                    "sending heartbeats (killed, frozen or cut off) while the job waited 2.3s "
                    "(budget 2.0s); "
                    "stacks in runs/a/hangs/generation_0")


def test_a_resume_live_replacement_could_not_serve_says_why_in_its_line():
    line = incident_line({"event": "checkpoint_loaded", "tier": "global", "step": 4,
                          "path": "runs/a/checkpoints/step_0000004",
                          "skipped": {"local": "the local tier is off",
                                      "live": "no live rank holds rank(s) [1]'s state at step "
                                              "39: no live data-parallel peer holds it"}})
    assert line == ("megaresil: resumed from runs/a/checkpoints/step_0000004 (step 4); the ranks' "
                    "memory could not serve: no live rank holds rank(s) [1]'s state at step 39: "
                    "no live data-parallel peer holds it")


def test_a_hang_that_names_an_unreachable_node_says_so_in_one_line():
    line = incident_line({"event": "hang_detected", "section": "optimizer", "step": 8,
                          "waited_s": 3.3, "budget_s": 2.0, "culprit_ranks": [6], "why": "stuck",
                          "stack_dump": "runs/a/hangs/generation_0",
                          "unreachable": [{"node": "1 on n1", "ranks": [4, 5, 6, 7], "since":
                                           time.mktime((2026, 12, 3, 7, 49, 12, 0, 0, -1))}]})
    assert line == ("megaresil: unreachable: node 1 on n1 (ranks [4, 5, 6, 7]) since 07:49:12: "
                    "no heartbeat from it while the job waited in optimizer at step 8 (3.3s, "
                    "budget 2.0s); a network partition or a frozen node; stacks in "
                    "runs/a/hangs/generation_0")


@pytest.mark.parametrize("command", ["chaos", "soak"])
def test_ctrl_c_ends_a_drill_with_one_line_not_a_traceback(monkeypatch, capsys, command):
    from megaresil.cli import main
    import megaresil.drills.chaos
    import megaresil.drills.soak

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(megaresil.drills.chaos, "run_scenario", interrupted)
    monkeypatch.setattr(megaresil.drills.soak, "run_soak", interrupted)
    options = ["--scenario", "kill-rank"] if command == "chaos" else ["--minutes", "1"]
    assert main([command, "gpt-tiny", *options]) == 130
    err = capsys.readouterr().err
    assert err == (f"megaresil: {command} stopped by Ctrl-C: nothing was reported; its runs "
                   "stopped, their directories stay under run.dir\n")


def failed_process(tmp_path: Path, local_rank: int, message: str, timestamp: int,
                   exitcode: int = 1):
    """A worker's failure as TorchElastic reads it: from the error file the
    worker wrote (as @record does), or with no file (message None)."""
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"error-{local_rank}.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {
            "message": message, "extraInfo": {"py_callstack": "", "timestamp": str(timestamp)}}}))
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode,
                          error_file=str(error_file))


def test_the_give_up_line_names_the_rank_whose_own_error_ended_the_job(tmp_path):
    """A rank whose peer failed sees only a closed connection, and may record
    it first (the worker that failed tears its groups down before its error
    file is written): the line names the cause, not the echo."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from megaresil.launch.agent import failure_summary

    echo = ("RuntimeError: [/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:37780. This is typically caused by a remote worker crashing.")
    cause = "InjectedFault: injected exception (raise@rank1/step2/data)"
    err = ChildFailedError("megaresil", {0: failed_process(tmp_path, 0, echo, 10),
                                         1: failed_process(tmp_path, 1, cause, 11)})
    assert failure_summary(err) == f"rank 1 ended with exit code 1: {cause}"
    only_echoes = ChildFailedError("megaresil", {0: failed_process(tmp_path, 0, echo, 10),
                                                 1: failed_process(tmp_path, 1, echo, 11)})
    assert failure_summary(only_echoes).startswith("rank 0 ended with exit code 1: RuntimeError")
    # Issue 47 item 3: a killed rank wrote nothing; its peer's echo is not the cause.
    killed = ChildFailedError("megaresil", {0: failed_process(tmp_path, 0, echo, 10),
                                            3: failed_process(tmp_path, 3, None, 11, -9)})
    assert failure_summary(killed) == ("rank 3 ended with signal SIGKILL: no report of its own "
                                       "(killed, out of memory or crashed)")
