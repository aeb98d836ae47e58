"""Real node boundaries on one machine (`--hosts netns`): each simulated node
in network, UTS and mount namespaces of its own, so it has its own address,
hostname and /dev/shm; the nodes talk over a bridge, and losing one kills its
processes and removes its namespace. The node-loss drill recovers there as it
does on one network. Needs root and iproute2; elsewhere these tests skip
and say why."""
from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.harness.cli import SMALL
from megaresil.config import ConfigError
from megaresil.drills.hosts import NetnsHosts, netns_missing_reason
from megaresil.events import read_events

needs_netns = pytest.mark.skipif(netns_missing_reason() is not None,
                                 reason=str(netns_missing_reason()))


def ours(hosts: NetnsHosts) -> tuple[list[str], list[str]]:
    """The namespaces and links named after the harness's prefix."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return ([n for n in namespaces.split() if n.startswith(hosts.prefix)],
            [line for line in links.splitlines() if hosts.prefix in line])


def on(hosts: NetnsHosts, node: int, code: str) -> str:
    result = subprocess.run(hosts.command(node, [sys.executable, "-c", code]),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@needs_netns
def test_nodes_have_their_own_name_and_shm_talk_over_the_bridge_and_die_whole():
    with NetnsHosts(2) as hosts:
        look = ("import os, socket\nopen('/dev/shm/mark', 'w').close()\n"
                "print(socket.gethostname(), socket.gethostbyname(socket.gethostname()),"
                " sorted(os.listdir('/dev/shm')))")
        assert on(hosts, 0, look) == f"{hosts.prefix}-node0 {hosts.address(0)} ['mark']"
        # Node 1's /dev/shm is another tmpfs: node 0's file is not there.
        assert on(hosts, 1, look) == f"{hosts.prefix}-node1 {hosts.address(1)} ['mark']"
        assert on(hosts, 1, "import os; os.remove('/dev/shm/mark')") == ""
        assert on(hosts, 0, "import os; print(os.listdir('/dev/shm'))") == "['mark']"
        # TCP from node 0 to a server on node 1's address, across the bridge.
        server = hosts.start(1, [sys.executable, "-c",
                                 "import socket, time\n"
                                 f"s = socket.create_server(({hosts.address(1)!r}, 5000))\n"
                                 "print('up', flush=True)\n"
                                 "c, _ = s.accept(); c.sendall(b'hello'); time.sleep(600)"],
                             stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "up"
        assert on(hosts, 0, f"import socket; print(socket.create_connection("
                            f"({hosts.address(1)!r}, 5000), timeout=10).recv(5).decode())"
                 ) == "hello"
        on_node_1, address = hosts.pids(1), hosts.address(1)
        assert server.pid in on_node_1
        hosts.lose(1)
        assert server.returncode == -9
        assert not [p for p in on_node_1 if psutil.pid_exists(p)
                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        namespaces, _ = ours(hosts)
        assert namespaces == [hosts.nodes[0].namespace]
        # Unreachable now, from the survivor.
        with pytest.raises(subprocess.CalledProcessError):
            subprocess.run(hosts.command(0, [sys.executable, "-c",
                           f"import socket; socket.create_connection(({address!r}, 5000), "
                           "timeout=3)"]), check=True, capture_output=True)
    assert ours(hosts) == ([], [])
    hosts.close()  # idempotent


def test_without_root_netns_is_refused_in_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"^--hosts: netns needs root .*run as root"):
        NetnsHosts(2)


def test_netns_is_refused_for_a_scenario_without_nodes(cli_main, tmp_path):
    result = cli_main("chaos", *SMALL, f"run.dir={tmp_path}", "--scenario", "kill-rank",
                      "--hosts", "netns", check=False)
    assert result.returncode == 2
    assert "--hosts: --scenario kill-rank runs no nodes" in result.stderr
    assert not list(tmp_path.iterdir())  # refused before anything ran


@needs_netns
@pytest.mark.slow
def test_node_loss_in_namespaces_recovers_at_dp1(cli_main, chaos_reference, tmp_path):
    result = cli_main("chaos", *SMALL, f"run.dir={tmp_path}", "--scenario", "node-loss",
                      "--step", "3", "--reference", str(chaos_reference), "--timeout", "300",
                      "--hosts", "netns")
    assert "hosts             netns" in result.stdout
    report = json.loads((tmp_path / "chaos-node-loss.json").read_text())
    assert report["recovered"] and report["final_loss_equal"], report
    assert report["hosts"] == "netns" and report["restart_kind"] == "relaunch"
    loaded = next(e for e in read_events(report["faulted"]) if e["event"] == "checkpoint_loaded")
    assert loaded["saved_layout"]["dp"] == 2 and loaded["layout"]["dp"] == 1
