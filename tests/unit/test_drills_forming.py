"""A node drill's job formed on fewer nodes than it has (an agent late for
the rendezvous' last call on a loaded machine) is started again, not struck."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megaresil.drills import run as drill_run
from megaresil.drills.run import Rendezvous, start_formed
from megaresil.events import EventLog, read_events


def fake_starts(monkeypatch, formed_sizes: list[int]) -> list[list[subprocess.Popen]]:
    """start_agents replaced: each start is two idle processes, and the
    job's first generation_started event says the next of `formed_sizes`."""
    sizes, started = iter(formed_sizes), []

    def start_agents(recipe, overrides, run_dir, world, hosts, rendezvous, spares):
        agents = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                  for _ in range(2)]
        EventLog(run_dir, rank=0).emit("generation_started", generation=0, step=0,
                                       world_size=next(sizes), launched_at=0.0)
        started.append(agents)
        return agents
    monkeypatch.setattr(drill_run, "start_agents", start_agents)
    return started


def stop(agents: list[subprocess.Popen]) -> None:
    for agent in agents:
        agent.kill()
        agent.wait()


def test_a_job_formed_on_one_node_of_two_is_started_again(monkeypatch, tmp_path, capsys):
    started = fake_starts(monkeypatch, [1, 2])
    agents = start_formed("recipe.yaml", [], tmp_path / "run", 2, None, Rendezvous(), 0)
    assert len(started) == 2 and agents is started[1]
    assert all(a.poll() is not None for a in started[0])  # the first start's processes killed
    # The run directory holds only the second start's job.
    assert [e["world_size"] for e in read_events(tmp_path / "run")] == [2]
    assert "formed with 1 of 2 ranks" in capsys.readouterr().err
    stop(agents)


def test_a_job_that_never_forms_whole_ends_the_drill(monkeypatch, tmp_path):
    started = fake_starts(monkeypatch, [1, 1, 1])
    with pytest.raises(RuntimeError, match="formed with fewer than its 2 ranks 3 times"):
        start_formed("recipe.yaml", [], tmp_path / "run", 2, None, Rendezvous(), 0)
    assert all(a.poll() is not None for agents in started for a in agents)
