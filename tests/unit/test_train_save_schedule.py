"""checkpoint.interval: auto (Young/Daly from measured costs), N, 0; the last step saved."""
import math

from megaresil.config import load_recipe
from megaresil.events import EventLog, read_events
from megaresil.train.save_schedule import Decision, SaveSchedule, job_mtbf_hours, mtbf_source


def schedule(tmp_path, *overrides, start_step: int = 0):
    cfg = load_recipe("recipes/gpt-tiny.yaml", ["train.steps=1000", f"run.dir={tmp_path}",
                                                *overrides])
    return SaveSchedule(cfg, start_step, events=EventLog(tmp_path, 0), rank=0)


def saved_steps(s, steps, step_s=1.0, save_s=2.0, first=1, batch=None):
    """`batch`: each step's global batch (the full one unless given)."""
    saved = []
    for step in range(first, steps + 1):
        s.step_done(step, step_s, batch or s.cfg.train.global_batch_size,
                    first_of_process=step == first)
        if s.due(step):
            saved.append(step)
            s.saved(step, save_s)
    return saved


def test_auto_measures_a_save_then_follows_young_daly(tmp_path):
    s = schedule(tmp_path, "resilience.mtbf_hours=1", "checkpoint.max_minutes_at_risk=60")
    saved = saved_steps(s, 1000)
    every = int(math.sqrt(2 * 2.0 * 3600))  # 120 s of 1 s steps
    assert saved[:3] == [4, 4 + every, 4 + 2 * every] and saved[-1] == 1000
    chosen = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_interval"]
    assert len(chosen) == 1 and chosen[0]["interval_steps"] == every
    assert "Young/Daly" in chosen[0]["line"]


def test_auto_is_capped_and_decides_again_when_a_cost_moves(tmp_path):
    s = schedule(tmp_path, "resilience.mtbf_hours=1000", "checkpoint.max_minutes_at_risk=1")
    saved_steps(s, 200)
    assert s.decision.steps == 60 and s.decision.capped
    for step in range(201, 300):  # steps become 3x slower
        s.step_done(step, 3.0, s.cfg.train.global_batch_size, first_of_process=False)
    assert s.decision.steps == 20


def test_auto_measures_a_batch_ramps_steps_as_full_batch_steps(tmp_path):
    """Half-batch steps of 0.5 s decide as full steps of 1 s: the interval
    holds once the ramp ends, and the ramp's steps save sooner."""
    s = schedule(tmp_path, "resilience.mtbf_hours=1", "checkpoint.max_minutes_at_risk=60")
    half = s.cfg.train.global_batch_size // 2
    saved = saved_steps(s, 300, step_s=0.5, batch=half)
    every = int(math.sqrt(2 * 2.0 * 3600))
    assert s.decision.step_s == 1.0 and saved[:2] == [4, 4 + every]


def test_an_integer_wins_and_zero_never_saves(tmp_path):
    assert saved_steps(schedule(tmp_path, "checkpoint.interval=300"), 1000) == [300, 600, 900, 1000]
    assert saved_steps(schedule(tmp_path, "checkpoint.interval=0"), 1000) == []
    assert saved_steps(schedule(tmp_path, "checkpoint.interval=0", "train.exit_at_step=7"),
                       1000) == [7]


def test_the_default_mtbf_comes_from_the_planner_profile_and_falls_with_size():
    small = job_mtbf_hours(load_recipe("recipes/gpt-tiny.yaml", ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1"]))
    large = job_mtbf_hours(load_recipe("recipes/gpt-tiny.yaml", ["parallel.dp=2048", "parallel.pp=1", "parallel.tp=1",
                                                                 "train.global_batch_size=8192"]))
    assert 1 < large < small


def test_a_decision_states_its_reason():
    d = Decision.choose(save_s=2.1, step_s=18.0, mtbf_h=5.3, max_minutes=30, run_steps=1000)
    assert d.line().startswith(f"checkpoint every {d.steps} steps (~")
    assert "save 2.1 s" in d.line() and "MTBF 5.3 h (resilience.mtbf_hours)" in d.line()


def test_auto_saves_a_short_run_at_least_every_quarter_of_it(tmp_path):
    """A 30-step run was told "checkpoint every 35 steps" after its step-4
    save: a crash near its end lost it all. At most a quarter of train.steps
    now lies between saves."""
    s = schedule(tmp_path, "train.steps=30")
    assert saved_steps(s, 30, step_s=4.0, save_s=1.0) == [4, 11, 18, 25, 30]
    chosen = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_interval"]
    assert chosen[0]["interval_steps"] == 7 and chosen[0]["capped"]
    assert chosen[0]["line"].endswith("capped at a quarter of train.steps")


def test_a_resume_takes_the_save_cost_from_the_runs_records(tmp_path):
    """The first job measured a save at step 4 and chose from it; the resume
    at step 500 makes no measuring save: it decides from that cost once its
    calibration steps are timed, and counts the interval from its start."""
    first = schedule(tmp_path, "resilience.mtbf_hours=1", "checkpoint.max_minutes_at_risk=60")
    assert saved_steps(first, 10) == [4]
    resumed = schedule(tmp_path, "resilience.mtbf_hours=1", "checkpoint.max_minutes_at_risk=60",
                       start_step=500)
    every = int(math.sqrt(2 * 2.0 * 3600))
    assert saved_steps(resumed, 800, first=501) == [500 + every, 500 + 2 * every]
    chosen = [e for e in read_events(tmp_path) if e["event"] == "checkpoint_interval"]
    assert [e["step"] for e in chosen] == [4, 504]
    assert chosen[1]["save_s"] == 2.0 and chosen[1]["interval_steps"] == every


def test_the_mtbf_line_names_the_profile_it_comes_from():
    cfg = load_recipe("recipes/gpt-tiny.yaml", ["parallel.tp=2", "parallel.pp=2", "parallel.dp=1"])
    source = mtbf_source(cfg)
    assert "llama3_405b profile" in source and "16,384 GPUs over 54 days" in source
    assert "scaled to 4 ranks" in source and "resilience.mtbf_hours" in source
    mine = load_recipe("recipes/gpt-tiny.yaml", ["resilience.mtbf_hours=7"])
    assert mtbf_source(mine) == "resilience.mtbf_hours"


def resumed_live(tmp_path, step: int, last_saved: int, *overrides) -> SaveSchedule:
    """A generation whose state came from the ranks' memory at `step`, the
    newest checkpoint at `last_saved`."""
    cfg = load_recipe("recipes/gpt-tiny.yaml", ["train.steps=1000", *overrides])
    return SaveSchedule(cfg, step, events=EventLog(tmp_path, 0), rank=0, last_saved=last_saved)


def test_a_save_live_replacement_interrupted_is_missed_and_then_not(tmp_path):
    """The issue's run: interval 5, the save of step 10 interrupted, the ranks'
    memory at step 10 (or past it, an async save's steps after it)."""
    every5 = "checkpoint.interval=5"
    assert resumed_live(tmp_path, 10, 5, every5).missed(10)
    assert resumed_live(tmp_path, 12, 5, every5).missed(12)
    assert not resumed_live(tmp_path, 9, 5, every5).missed(9)  # the save of 10 is still ahead
    assert not resumed_live(tmp_path, 10, 10, every5).missed(10)  # it was committed
    s = resumed_live(tmp_path, 10, 5, every5)
    s.saved(10, 1.0)
    assert not s.missed(10) and saved_steps(s, 20, first=11) == [15, 20]


def test_the_last_step_and_exit_at_step_saves_are_missed_whatever_the_interval(tmp_path):
    assert resumed_live(tmp_path, 1000, 990, "checkpoint.interval=auto").missed(1000)
    assert resumed_live(tmp_path, 7, 0, "checkpoint.interval=0", "train.exit_at_step=7").missed(7)
    assert not resumed_live(tmp_path, 7, 0, "checkpoint.interval=0").missed(7)
    assert not resumed_live(tmp_path, 7, 0, "checkpoint.interval=auto").missed(7)
