"""`megaresil plan` takes the control plane's simulated latencies
(plan/control_plane.py): the loader of the bench's JSON and of the packaged
copy, a malformed file refused in one line, the interpolation by world
size, and the command from a directory outside the repository, where the
figures change the projection."""
from __future__ import annotations

import json

import pytest

from megaresil.plan.control_plane import (
    DEFAULT_CONTROL_PLANE,
    ControlPlane,
    Row,
    format_control_plane,
    load_control_plane,
    packaged,
)
from tests.harness.cli import ROOT
from tests.unit.test_plan import write_run_with_a_replacement


def bench_row(world: int, detected: float, aborted: float, agreed: float) -> dict:
    """A row as bench/control_plane.py writes it, with fields the plan ignores."""
    return {"world": world, "nodes": world // 8, "steady": {"per_s": {"calls": 1.0}},
            "fault": {"seconds": aborted, "detected_s": detected, "all_aborted_s": aborted},
            "replacement": {"wait_s": 1.0 + agreed, "after_join_s": agreed}}


def write(tmp_path, rows, name="cp.json"):
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


def test_the_bench_json_loads_its_four_fields_by_world(tmp_path):
    path = write(tmp_path, [bench_row(4096, 12.0, 14.0, 0.2), bench_row(1024, 7.0, 8.0, 0.1)])
    plane = load_control_plane(path)
    assert plane.rows == (Row(1024, 7.0, 8.0, 0.1), Row(4096, 12.0, 14.0, 0.2))
    assert plane.source == str(path)


def test_the_packaged_copy_loads_and_is_the_benchs_results(tmp_path):
    """The packaged copy is what bench/control_plane_profile.py writes of the
    bench's results: refreshed with them."""
    plane = load_control_plane()
    assert plane.source.startswith("packaged plan/profiles/control_plane.yaml, copied from "
                                   "bench/results/control_plane.json")
    results = json.loads((ROOT / "bench" / "results" / "control_plane.json").read_text())
    fresh = load_control_plane(write(tmp_path, packaged(results, "the bench's results")))
    assert plane.rows == fresh.rows, ("megaresil/plan/profiles/control_plane.yaml is older "
                                      "than bench/results/control_plane.json: run "
                                      "python bench/control_plane_profile.py")


@pytest.mark.parametrize("content, problem", [
    ("[]", "holds no rows"),
    ("{not json", "is neither JSON nor YAML"),
    (json.dumps([{"world": 1024, "fault": {"detected_s": 7.0}}]),
     "row 0 has no 'fault.all_aborted_s'"),
    (json.dumps([bench_row(1024, -1.0, 8.0, 0.1)]), "row 0's 'fault.detected_s' is not a finite"),
    (json.dumps([bench_row(0, 1.0, 8.0, 0.1)]), "row 0's 'world' is not a whole number"),
    (json.dumps([bench_row(64, 1.0, 2.0, 0.1)] * 2), "two rows of one world"),
    (json.dumps({"source": "x"}), "holds no rows"),
])
def test_a_malformed_file_is_refused_in_one_line_naming_it_and_the_fix(tmp_path, content,
                                                                       problem):
    path = tmp_path / "cp.json"
    path.write_text(content)
    with pytest.raises(ValueError) as err:
        load_control_plane(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and problem in message
    assert "Fix: give the JSON bench/control_plane.py writes" in message


def test_a_missing_file_is_refused_so_too(tmp_path):
    with pytest.raises(ValueError, match=r"control-plane figures .*nothing.json: .*Fix:"):
        load_control_plane(tmp_path / "nothing.json")


PLANE = ControlPlane("t", (Row(1024, 10.0, 12.0, 0.1), Row(4096, 20.0, 24.0, 0.3)))


def test_figures_are_linear_in_log_world_between_rows_and_the_nearest_beyond():
    mid = PLANE.at(2048, "detected_s")  # halfway in log2: 11 of 10..12
    assert (mid.value, mid.measured_at, mid.extrapolated) == (15.0, (1024, 4096), False)
    assert PLANE.at(4096, "all_aborted_s").value == 24.0
    assert not PLANE.at(4096, "all_aborted_s").extrapolated
    beyond = PLANE.at(16384, "detected_s")
    assert (beyond.value, beyond.measured_at, beyond.extrapolated) == (20.0, (4096,), True)
    below = PLANE.at(8, "agreed_s")
    assert (below.value, below.measured_at, below.extrapolated) == (0.1, (1024,), True)
    assert PLANE.at(1024, "agreed_s").extrapolated is False


def test_what_each_recovery_path_is_charged_over_the_smallest_size():
    assert PLANE.path_s(4096) == pytest.approx(
        {"in_process": 4.0, "relaunch": 24.0, "replace": 24.3})
    # The run's own downtime stands for the 1,024-rank figures: their growth is added.
    assert PLANE.added_s(4096) == pytest.approx(
        {"in_process": 2.0, "relaunch": 12.0, "replace": 12.2})
    assert PLANE.added_s(1024) == PLANE.added_s(8) == {
        "in_process": 0.0, "relaunch": 0.0, "replace": 0.0}
    described = PLANE.describe(16384)
    assert described["extrapolated"] and described["measured_at"] == [4096]


def packaged_line_prefix() -> str:
    """The start of the plan's line on the packaged figures at 16,384 GPUs,
    however the packaged rows were measured (refreshing them changes it)."""
    line = format_control_plane([load_control_plane().describe(16384)])[0]
    assert "packaged plan/profiles/control_plane.yaml, copied from " in line
    return line.split(", copied from ")[0]


def plan_in(*args: str) -> int:
    """`megaresil plan ARGS` through main(), what the console script calls,
    in the test's directory (outside the repository: no bench/ beside it)."""
    from megaresil.cli import main

    return main(["plan", *args])


def test_the_command_takes_the_figures_and_they_change_the_projection(tmp_path, monkeypatch,
                                                                       capfd):
    run = tmp_path / "run"
    write_run_with_a_replacement(run, downtime_s=3.0)
    home = tmp_path / "user"
    home.mkdir()
    monkeypatch.chdir(home)
    assert plan_in(str(run), "--gpus", "1024") == 0
    text = capfd.readouterr().out
    assert packaged_line_prefix() in text
    quick = write(tmp_path, [bench_row(1024, 1.0, 2.0, 0.0), bench_row(4096, 1.0, 2.0, 0.0)])
    slow = write(tmp_path, [bench_row(1024, 1.0, 2.0, 0.0), bench_row(4096, 51.0, 62.0, 0.0)],
                 "slow.json")
    plans = {}
    for name, path in (("quick", quick), ("slow", slow)):
        assert plan_in(str(run), "--gpus", "1024", "--control-plane", str(path),
                       "--json") == 0
        plans[name] = json.loads(capfd.readouterr().out)
    at_16k = {name: {r["policy"]: r for r in p["recovery"]["projections"][0]["policies"]}
              for name, p in plans.items()}
    quick_row, slow_row = (at_16k[n]["live replacement + hot spares"] for n in ("quick", "slow"))
    # Every path 60 s dearer at 16,384 GPUs (the 4,096 row's, extrapolated) ...
    assert slow_row["mean_restart_s"] == pytest.approx(quick_row["mean_restart_s"] + 60.0)
    assert slow_row["expected_goodput"] < quick_row["expected_goodput"]
    # ... and nothing at 1,024 GPUs, where both files measured the same.
    assert plans["slow"]["restart_s"] == plans["quick"]["restart_s"]
    assert plans["slow"]["control_plane"][0]["source"] == str(slow)


def test_the_command_refuses_a_malformed_file(tmp_path, monkeypatch, capfd):
    run = tmp_path / "run"
    write_run_with_a_replacement(run, downtime_s=3.0)
    bad = write(tmp_path, [{"world": 8}])
    monkeypatch.chdir(tmp_path)
    assert plan_in(str(run), "--gpus", "8", "--control-plane", str(bad)) == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "Fix:" in err
    assert DEFAULT_CONTROL_PLANE.name in err
