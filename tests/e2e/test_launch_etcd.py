"""Rendezvous without a single survivor: with TorchElastic's etcd rendezvous
on a real etcd server, losing the node that started first (the one a c10d
rendezvous cannot lose) leaves the other to re-form at dp=1 and finish with
the reference's losses; with c10d the same loss ends the job with one line
saying why and what to use. Restart numbers and back-off come from the run
directory, so they outlive the node whose store held the attempt's state."""
from __future__ import annotations

import json
import time
import urllib.request

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (RendezvousClosedError,
                                                  RendezvousConnectionError,
                                                  RendezvousTimeoutError)

from tests.harness.cli import SMALL
from tests.harness.daemons import serve
from megaresil.config import ConfigError
from megaresil.drills.etcd import EtcdServer, etcd_missing_reason
from megaresil.events import EventLog, read_events
from megaresil.launch.agent import rendezvous_lost
from megaresil.launch.membership import Membership
from megaresil.resilience.abort_board import AbortBoard
from megaresil.resilience.records import relaunches_without_progress, restarts_recorded
from megaresil.slurm import SlurmStep
from tests.e2e.test_slurm import step_env

needs_etcd = pytest.mark.skipif(etcd_missing_reason() is not None,
                                reason=str(etcd_missing_reason()))


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    yield from serve(EtcdServer, etcd_missing_reason, tmp_path_factory.mktemp("etcd"))


@needs_etcd
def test_etcd_server_serves_the_v2_api_and_stops(tmp_path):
    import etcd as python_etcd

    server = EtcdServer(tmp_path).start()
    client = python_etcd.Client(host="127.0.0.1", port=server.client_port)
    client.write("/megaresil/probe", "1")
    assert client.read("/megaresil/probe").value == "1"
    server.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://{server.endpoint}/v2/keys", timeout=2)


def test_etcd_backend_is_chosen_and_needs_the_server_endpoint():
    membership = Membership.parse("1:2", 2, "etcd0:2379", "job", backend="etcd-v2")
    assert (membership.backend, membership.endpoint) == ("etcd-v2", "etcd0:2379")
    assert membership.host_can_be_lost
    assert not Membership.parse("1:2", 2, "node0:29500", "job").host_can_be_lost
    with pytest.raises(ConfigError, match="ETCD_HOST:PORT"):
        Membership.parse("1:2", 2, None, "job", backend="etcd")


def test_etcd_under_slurm_meets_at_the_server_once_per_requeue(monkeypatch):
    step = SlurmStep.from_environ(step_env(SLURM_STEP_TASKS_PER_NODE="1(x2)",
                                           SLURM_STEP_NUM_TASKS="2"))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    membership = Membership.for_slurm(step, 8, None, "etcd-v2", "etcd0:2379")
    assert (membership.min_nodes, membership.max_nodes, membership.nproc_per_node) == (1, 2, 4)
    assert (membership.endpoint, membership.run_id) == ("etcd0:2379", "slurm-4242-3")
    with pytest.raises(ConfigError, match="ETCD_HOST:PORT"):
        Membership.for_slurm(step, 8, None, "etcd-v2", None)


def test_etcd_is_what_a_lost_c10d_host_is_told_to_use():
    lost = RendezvousConnectionError("connection refused")
    c10d = rendezvous_lost(Membership.parse("1:2", 2, "node0:29500", "job"), lost)
    assert "c10d rendezvous host node0:29500 is gone" in c10d
    assert "--rdzv-backend etcd-v2 --rdzv-endpoint ETCD_HOST:PORT" in c10d
    etcd = rendezvous_lost(Membership.parse("1:2", 2, "etcd0:2379", "job", backend="etcd"), lost)
    assert "etcd0:2379" in etcd and "--rdzv-backend" not in etcd
    late = rendezvous_lost(Membership.parse("1:2", 2, "node0:29500", "job"),
                           RendezvousTimeoutError("join timed out"))
    assert "RendezvousTimeoutError: join timed out" in late and "is gone" not in late
    reused = rendezvous_lost(Membership.parse("1:2", 2, "etcd0:2379", "job", backend="etcd-v2"),
                             RendezvousClosedError())
    assert "'job' at etcd0:2379 is closed" in reused and "its own --rdzv-id" in reused


def test_etcd_restart_numbers_and_back_off_come_from_the_run_directory(tmp_path):
    """What a new launch store (a lost node's replacement) no longer holds:
    the restarts so far, and the relaunches since the last step."""
    log = EventLog(tmp_path, 0)
    log.emit("restart", kind="relaunch", generation=1)
    log.emit("restart", kind="in_process", generation=2)
    assert restarts_recorded(tmp_path) == 2
    assert relaunches_without_progress(tmp_path) == 1
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.0,
                                                        "time": time.time()}) + "\n")
    assert relaunches_without_progress(tmp_path) == 0  # a step done since: no back-off
    time.sleep(0.01)
    log.emit("restart", kind="relaunch", generation=3)
    assert relaunches_without_progress(tmp_path) == 1
    assert restarts_recorded(tmp_path) == 3


class GoneStore(dist.Store):
    """A launch store whose host went with the lost node."""

    def check(self, keys):
        raise dist.DistNetworkError("sendBytes failed: Broken pipe")


def test_etcd_a_peer_that_took_the_store_with_it_is_a_lost_peer():
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:5300")
    board = AbortBoard(GoneStore(), rank=1)
    assert board.peer_gone(0, closed)
    assert not board.peer_gone(0, RuntimeError("something else"))


@needs_etcd
def test_etcd_an_agents_rendezvous_rides_out_the_servers_outage(tmp_path, capsys):
    # TorchElastic's own etcd-v2 handler, wrapped as the launcher does: with
    # the server stopped, "how many nodes wait" is "none" (training goes on),
    # said once; with it back, said again. Registering twice in one process
    # (a second launch) is no error.
    from torch.distributed.elastic.rendezvous import (RendezvousParameters,
                                                      rendezvous_handler_registry)
    from megaresil.launch.rendezvous import launch_backend, register_wrapped

    def said() -> list[str]:
        return [line for line in capsys.readouterr().err.splitlines() if "rendezvous at" in line]

    server = EtcdServer(tmp_path).start()
    register_wrapped()
    register_wrapped()
    handler = rendezvous_handler_registry.create_handler(RendezvousParameters(
        launch_backend("etcd-v2"), server.endpoint, f"outage-{time.time_ns()}", 1, 2,
        read_timeout=5))
    try:
        assert handler.num_nodes_waiting() == 0 and said() == []
        server.stop()
        time.sleep(1.5)  # past the handler's cache of the state (1 s)
        assert handler.num_nodes_waiting() == 0 and handler.num_nodes_waiting() == 0
        out = said()
        assert len(out) == 1 and f"{server.endpoint} is out of reach" in out[0]
        server.start()
        time.sleep(1.5)
        assert handler.num_nodes_waiting() == 0
        assert "answers again" in said()[0]
    finally:
        server.stop()


def chaos_first_node_loss(cli_main, reference, run_dir, *backend: str):
    return cli_main("chaos", *SMALL, f"run.dir={run_dir}", "--scenario", "node-loss-first",
                    "--step", "3", "--reference", str(reference), *backend, check=False)


@pytest.mark.slow
@needs_etcd
def test_etcd_first_node_loss_reforms_at_dp1(cli_main, etcd, chaos_reference, tmp_path):
    result = chaos_first_node_loss(cli_main, chaos_reference, tmp_path,
                                   "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", etcd.endpoint)
    report = json.loads((tmp_path / "chaos-node-loss-first.json").read_text())
    assert result.returncode == 0 and report["exit_code"] == 0, result.stderr[-3000:]
    assert report["recovered"] and report["final_loss_equal"], report
    events = read_events(report["faulted"])
    loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
    assert loaded[-1]["saved_layout"]["dp"] == 2 and loaded[-1]["layout"]["dp"] == 1
    # The survivor names the lost peer although the store went with it.
    assert any(e["event"] == "worker_error" and e["lost_peer"] for e in events), events
    restarts = [e for e in events if e["event"] == "restart"]
    assert [(e["kind"], e["generation"]) for e in restarts] == [("relaunch", 1)]
    assert "run_finished" in [e["event"] for e in events]


@pytest.mark.slow
def test_etcd_c10d_first_node_loss_says_to_use_etcd(cli_main, chaos_reference, tmp_path):
    result = chaos_first_node_loss(cli_main, chaos_reference, tmp_path)
    report = json.loads((tmp_path / "chaos-node-loss-first.json").read_text())
    assert report["exit_code"] == 1 and not report["recovered"], report
    assert result.returncode == 1
    giving_up = [line for line in result.stderr.splitlines() if "giving up" in line]
    assert len(giving_up) == 1, result.stderr[-3000:]
    assert "c10d rendezvous host" in giving_up[0] and "is gone" in giving_up[0]
    assert "--rdzv-backend etcd-v2 --rdzv-endpoint ETCD_HOST:PORT" in giving_up[0]
