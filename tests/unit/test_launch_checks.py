"""What no restart can cure is said once, before any worker starts (exit 2,
one line naming the key and the fix), and classified fatal at once where a
worker meets it; the guardian says what it sees of a process that stopped."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.harness.cli import SMALL
from megaresil.data.indexed import IndexedDatasetWriter
from megaresil.events import read_events, read_metrics
from megaresil.resilience.guardian import stopped, why_no_progress

TINY = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
        "train.steps=2", "logging.progress=false", "logging.tensorboard=false"]


def refused(cli_main, *args: str) -> str:
    """The one line `megaresil ARGS` exits 2 with."""
    result = cli_main(*args, check=False)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("megaresil: error: ") and "Fix: " in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("override,key", [
    ("data.source=/etc/passwd", "data.seq_len"),  # 23 tokens of valid data, samples need 129
    ("model.vocab_size=10", "model.vocab_size"),  # below the byte-level BPE's 257
    ("data.tokenizer=byte model.vocab_size=100", "model.vocab_size"),  # below the 257 byte ids
    ("data.tokenizer=foo", "data.tokenizer"),  # no such tokenizer: was a traceback, exit 1
])
def test_data_no_worker_could_use_is_refused_by_the_launcher(cli_main, tmp_path, override, key):
    run_dir = tmp_path / "run"
    line = refused(cli_main, "train", *TINY, *override.split(), f"run.dir={run_dir}",
                   f"data.cache_dir={tmp_path / 'cache'}")
    assert line.startswith(f"megaresil: error: {key}: ")
    assert not (run_dir / "events.jsonl").exists()  # no worker started


def test_a_fault_on_a_rank_the_job_lacks_is_refused(cli_main, tmp_path):
    line = refused(cli_main, "train", *TINY, f"run.dir={tmp_path}",
                   "faults=[{kind: kill, rank: 1, step: 1}]")
    assert line.startswith("megaresil: error: faults[0].rank: 1 is not a rank of this job")


def test_a_recipe_path_that_is_a_directory_is_a_recipe_error(cli_main, tmp_path):
    line = refused(cli_main, "train", str(tmp_path))
    assert line == (f"megaresil: error: {tmp_path}: is a directory, not a recipe file. "
                    "Fix: give a recipe's .yaml file, e.g. recipes/gpt-tiny.yaml.")


def test_the_guardian_says_a_stopped_process_is_not_running():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert "GIL" in why_no_progress(child.pid)
        child.send_signal(signal.SIGSTOP)
        for _ in range(250):  # until the kernel has delivered the signal
            if stopped(child.pid):
                break
            time.sleep(0.02)
        assert why_no_progress(child.pid) == "not running: stopped or starved"
    finally:
        child.kill()
        child.wait()


@pytest.mark.slow
def test_token_ids_past_the_vocabulary_stop_the_job_at_once(cli, cli_main, tmp_path):
    """Indexed data made with GPT-2's tokenizer elsewhere (no record of it)
    read as byte data by a model of 300 tokens: the tokenizer named fits the
    model, the data does not, so each sample is checked as it is read, and
    the first bad one ends the job on every rank without a restart (it would
    fail the same way every time)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"line {i}: the quick brown fox ~~~"}) + "\n"
                              for i in range(200)))
    prefix = tmp_path / "data" / "corpus"
    cli_main("data", "prepare", "--input", str(corpus), "--json-key", "text", "--output",
             str(prefix), "--tokenizer", "gpt2")  # in-process: only the job is under test
    (tmp_path / "data" / "corpus.prepared.json").unlink()
    run_dir = tmp_path / "run"
    result = cli("train", *SMALL, f"run.dir={run_dir}", "logging.progress=false",
                 "data.source=indexed", f"data.path={prefix}", "data.tokenizer=byte",
                 "model.vocab_size=300", "data.seq_len=32", "resilience.max_restarts=1",
                 check=False)
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("megaresil: giving up: rank ") and "model.vocab_size" in last
    assert "(no restart can fix this)" in last
    events = read_events(run_dir)
    assert not [e for e in events if e["event"] == "restart"]
    assert len([e for e in events if e["event"] == "run_failed"]) == 1


def test_the_te_backend_without_transformer_engine_is_refused_by_the_launcher(cli_main,
                                                                              tmp_path):
    """No restart installs a library: one line before any worker starts (every
    worker raised it, through every restart, before)."""
    from megaresil.model import te

    if te.available():
        pytest.skip("Transformer Engine is installed here")
    line = refused(cli_main, "train", *TINY, f"run.dir={tmp_path}", "model.backend=te")
    assert line.startswith("megaresil: error: model.backend: te needs NVIDIA Transformer Engine")
    assert not (tmp_path / "events.jsonl").exists()


# --- the run directory's records (issue 46 item 12) -----------------------------------------

EVENT = '{"time": 1.0, "event": "restart", "kind": "relaunch"}\n'
ROW = '{"step": 1, "loss": 5.0, "time": 2.0}\n'


@pytest.mark.parametrize("name,content,problem", [
    ("events.jsonl", EVENT + "garbage\n" + EVENT, "events.jsonl line 2: 'garbage' is not JSON."),
    ("events.jsonl", EVENT + '{"kind": "relaunch"}\n',
     'events.jsonl line 2: \'{"kind": "relaunch"}\' has no "event" name.'),
    ("metrics.jsonl", ROW + '{"step": 2, "lo\n' + ROW,
     'metrics.jsonl line 2: \'{"step": 2, "lo\' is not JSON.'),
])
def test_a_damaged_record_is_refused_naming_file_and_line(cli_main, tmp_path, name, content,
                                                          problem):
    """A damaged line failed inside every worker, burnt every relaunch
    (55 s) and gave up "after 0 relaunches" without naming the file."""
    (tmp_path / name).write_text(content)
    line = refused(cli_main, "train", *TINY, f"run.dir={tmp_path}")
    assert line == (f"megaresil: error: {tmp_path}/{problem} Fix: repair or delete that line "
                    "(megaresil only appends to this file; a deleted line loses only that "
                    "record).")
    assert (tmp_path / name).read_text() == content  # nothing written, nothing repaired
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize("directory", [False, True], ids=["garbage", "directory"])
def test_a_damaged_fence_is_refused_naming_the_generation_to_write_back(cli_main, tmp_path,
                                                                        directory):
    (tmp_path / "events.jsonl").write_text(EVENT * 3)  # three restarts: generation 3
    fence = tmp_path / "generation"
    fence.mkdir() if directory else fence.write_text("three\n")
    line = refused(cli_main, "train", *TINY, f"run.dir={tmp_path}")
    what = "is a directory" if directory else "holds 'three'"
    away = "move that directory away, then " if directory else ""
    assert line == (f"megaresil: error: {fence}: {what}, not the fence megaresil writes there "
                    '("NUMBER TOKEN" as each generation of the job forms). Fix: with no job '
                    f"running on this run directory, {away}write back the generation "
                    f"events.jsonl records: echo '3 restored' > {fence}")
    assert fence.is_dir() if directory else fence.read_text() == "three\n"


@pytest.mark.slow
def test_a_torn_last_line_does_not_block_a_resume(cli, tmp_path):
    """A kill -9 of the launcher inside a write leaves the last line of
    events.jsonl or metrics.jsonl torn, and the steps after the newest
    checkpoint unsaved: the launcher's check lets the torn line pass (it is
    skipped, the writers start a new line after it), and the rerun says
    which steps it trains again, not "attempt 0 of 5" (issue 46 item 16b)."""
    run = [*TINY, "train.steps=3", f"run.dir={tmp_path}", "checkpoint.interval=1"]
    cli("train", *run, "train.exit_at_step=1")
    with open(tmp_path / "metrics.jsonl", "a") as f:  # step 2, trained, never saved
        f.write('{"step": 2, "loss": 5.0, "time": 3.0}\n{"step": 3, "lo')
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"time": 3.0, "ev')
    result = cli("train", *run)
    assert "error" not in result.stderr and "attempt 0" not in result.stderr, result.stderr
    assert ("megaresil: resuming from step 1: the previous launch ended after step 2 without "
            "saving it (its launcher was killed, or it failed); step 2 is trained again"
            ) in result.stderr.splitlines(), result.stderr
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 2, 3]


def test_a_local_tier_inside_the_checkpoint_root_is_refused_before_any_worker(cli_main,
                                                                             tmp_path):
    run_dir = tmp_path / "run"
    line = refused(cli_main, "train", *TINY, f"run.dir={run_dir}",
                   "checkpoint.local.enabled=true",
                   f"checkpoint.local.dir={run_dir}/checkpoints/local")
    assert line.startswith("megaresil: error: checkpoint.local.dir: ")
    assert "lies inside the global checkpoint root" in line
    assert not run_dir.exists()  # no worker started: none made the run directory


def test_document_masking_without_documents_to_find_is_refused(cli_main, tmp_path):
    """Synthetic data has no documents; indexed data prepared without an eod
    after each document (Megatron's --append-eod off) has no boundaries."""
    masked = ["data.reset_attention_mask=true", f"run.dir={tmp_path / 'run'}"]
    line = refused(cli_main, "train", *TINY, "data.source=synthetic", *masked)
    assert line.startswith("megaresil: error: data.reset_attention_mask: synthetic data has no "
                           "documents")
    prefix = tmp_path / "plain"
    with IndexedDatasetWriter(prefix, "uint16") as writer:
        for i in range(200):
            writer.add_document([1 + i % 7] * 9)  # no eod (256) after any of them
        writer.finalize()
    line = refused(cli_main, "train", *TINY, "data.source=indexed", f"data.path={prefix}",
                   "data.tokenizer=byte", "data.seq_len=16", *masked)
    assert line.startswith(f"megaresil: error: data.path: the documents of {prefix} do not all "
                           "end with the end-of-document token 256")
    assert not (tmp_path / "run" / "events.jsonl").exists()  # no worker started
