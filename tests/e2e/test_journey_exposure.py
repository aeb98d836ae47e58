"""User journeys of issue 34's exposure items: what a run opens to the
network, and untrusted Hugging Face inputs refused before any worker starts.
Through the installed `megaresil`, from a fresh directory (pytest -m journey)."""
from __future__ import annotations

import ipaddress
import time

import psutil
import pytest

from megaresil.events import read_metrics
from tests.harness.cli import ROOT
from tests.harness.journey import home, interrupt, megaresil, start  # noqa: F401  (home: a fixture)

pytestmark = pytest.mark.journey

GPT_TINY = [str(ROOT / "recipes" / "gpt-tiny.yaml"), "parallel.tp=1", "parallel.pp=1",
            "data.source=synthetic", "data.seq_len=32", "model.num_layers=2",
            "model.hidden_size=64", "model.num_heads=4", "train.micro_batch_size=2",
            "train.global_batch_size=4", "train.eval_batches=0", "logging.progress=false",
            "logging.tensorboard=false", "checkpoint.interval=0"]


def listening_addresses(root: psutil.Process) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that `root` or a descendant listens on."""
    found = set()
    for process in [root, *root.children(recursive=True)]:
        try:
            found |= {(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:  # a worker that ended meanwhile listens on nothing
            pass
    return found


def wait_for_steps(run_dir, steps: int, proc, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while len([r for r in read_metrics(run_dir) if "loss" in r]) < steps:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the run made no steps"
        time.sleep(0.5)


def test_a_single_node_run_listens_on_loopback_only(home):
    proc = start("train", *GPT_TINY, "parallel.dp=2", "train.steps=100000", "run.dir=runs/a",
                 cwd=home)
    try:
        wait_for_steps(home / "runs" / "a", 2, proc)
        listening = listening_addresses(psutil.Process(proc.pid))
    finally:
        interrupt(proc)
        proc.wait(timeout=120)
    # The launcher's two stores (rendezvous, agent) and the ranks' gloo pairs.
    assert len(listening) >= 2, listening
    exposed = {(ip, port) for ip, port in listening if not ipaddress.ip_address(ip).is_loopback}
    assert not exposed, f"listening beyond loopback: {sorted(exposed)}"


def test_a_malformed_tokenizer_stops_train_and_convert_before_they_start(home):
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=300,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(home / "hf")
    tokenizer = home / "hf" / "tokenizer.json"
    tokenizer.write_text('{"version": "1.0", "trunc')
    train = megaresil("train", *GPT_TINY, "parallel.dp=1", "--from-hf", "hf", "train.steps=2",
                      "run.dir=runs/t", cwd=home, check=False)
    convert = megaresil("convert", "--from-hf", "hf", "imported", cwd=home, check=False)
    for result in (train, convert):
        assert result.returncode == 2, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if "megaresil: error" in line]
        assert len(errors) == 1 and "tokenizer.json cannot be read as a tokenizer" in errors[0]
        assert "Traceback" not in result.stderr
    assert not (home / "runs" / "t" / "elastic").exists()  # no worker was started
    assert not (home / "imported").exists()
