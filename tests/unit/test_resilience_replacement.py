"""Live replacement's meeting protocol (resilience/replacement.py) and the
choice of where every rank's state comes from (train/handover.live_plan),
a donor's proof among it, on a store in memory and a fake clock."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from megaresil.drills.store_meter import CountingStore, Tally
from megaresil.resilience.coordination import JobStore
from megaresil.resilience.replacement import (
    ENTERED_POLL_S,
    NOTICE_S,
    POLL_S,
    ReplacementFailed,
    await_members,
    judges_the_wait,
)
from megaresil.train.handover import Held, live_plan
from tests.harness.fake_clock import FakeClock

# The protocol's steps, called as the functions they were before JobStore.
announce_replacement, enter = JobStore.announce_replacement, JobStore.enter
generation_to_join, lost_in_setup, set_up = (JobStore.generation_to_join, JobStore.lost_in_setup,
                                             JobStore.set_up)


def set_pid(store, generation: int, rank: int, pid: int) -> None:
    store.store.set(f"gen{generation}/pid/{rank}", str(pid))


def test_the_wait_ends_when_every_rank_entered():
    store, clock = JobStore(dist.HashStore()), FakeClock()
    for rank in range(2):
        enter(store, 1, rank)
    await_members(store, 1, 2, 60.0, clock=clock)
    assert clock.now == 0.0


def test_a_lost_rank_nobody_replaces_ends_the_wait_after_the_notice():
    store, clock = JobStore(dist.HashStore()), FakeClock()
    set_pid(store, 0, 1, 4242)  # rank 1's process of generation 0, lost
    enter(store, 1, 0)
    with pytest.raises(ReplacementFailed, match=r"no replacement was started for rank\(s\) \[1\]"):
        await_members(store, 1, 2, 120.0, clock=clock)
    assert NOTICE_S < clock.now < NOTICE_S + 1


def test_a_replacement_on_its_way_is_waited_for_up_to_the_join_timeout():
    store, clock = JobStore(dist.HashStore()), FakeClock()
    set_pid(store, 0, 1, 4242)
    announce_replacement(store, 4242, 4343)
    enter(store, 1, 0)
    with pytest.raises(ReplacementFailed, match="did not join within 30s"):
        await_members(store, 1, 2, 30.0, clock=clock)
    assert 30.0 < clock.now < 31.0


def test_a_replacement_lost_in_turn_is_looked_up_by_its_own_pid():
    """Rank 1's first replacement (pid 2) entered generation 1 and died;
    the agent replaced pid 2: the others wait for the second one in
    generation 2."""
    store, clock = JobStore(dist.HashStore()), FakeClock()
    set_pid(store, 0, 1, 1)
    announce_replacement(store, 1, 2)
    set_pid(store, 1, 1, 2)
    announce_replacement(store, 2, 3)
    enter(store, 2, 0)
    with pytest.raises(ReplacementFailed, match="did not join"):
        await_members(store, 2, 2, 20.0, clock=clock)


def test_a_rank_entering_twice_is_counted_once():
    """A retried entry (or a rank's second process in one generation) must
    not stand in for a missing rank: the count alone ends the wait."""
    store, clock = JobStore(dist.HashStore()), FakeClock()
    set_pid(store, 0, 1, 4242)
    announce_replacement(store, 4242, 4343)  # rank 1's replacement is on its way
    assert [enter(store, 1, 0), enter(store, 1, 0)] == [1, 0]
    assert store.entered_count(1) == 1
    with pytest.raises(ReplacementFailed, match=r"replacement of rank\(s\) \[1\] did not join"):
        await_members(store, 1, 2, 10.0, clock=clock)
    assert enter(store, 1, 1) == 2 and store.entered_count(1) == 2
    await_members(store, 1, 2, 10.0, clock=clock)


def counted(inner: dist.Store) -> tuple[JobStore, Tally]:
    tally = Tally()
    return JobStore(CountingStore(inner, tally)), tally


def test_only_the_first_ranks_in_judge_the_wait():
    assert [judges_the_wait(a) for a in range(4)] == [False, True, True, False]


def test_a_waiting_rank_reads_one_key_a_look_and_takes_the_judges_verdict():
    """World 64, rank 63 lost with nobody replacing it: a judge names it
    after NOTICE_S and records why; a rank that does not judge reads the
    count each look and that verdict each POLL_S, one key each, never a
    member's key, and ends with the judge's reason."""
    shared = dist.HashStore()
    judge, _ = counted(shared)
    set_pid(judge, 0, 63, 4242)
    for rank in range(63):
        enter(judge, 1, rank)
    with pytest.raises(ReplacementFailed, match=r"rank\(s\) \[63\]") as judged:
        await_members(judge, 1, 64, 120.0, clock=FakeClock())
    other, tally = counted(shared)
    clock = FakeClock()
    with pytest.raises(ReplacementFailed) as read:
        await_members(other, 1, 64, 120.0, judge=False, clock=clock)
    assert str(read.value) == str(judged.value) and clock.now == 0.0
    assert set(tally.calls) == {("add", "genN/entered"), ("check", "genN/members_failed"),
                                ("get", "genN/members_failed")}
    assert sum(tally.keys.values()) == sum(tally.calls.values()) == 3


def test_a_rank_that_does_not_judge_gives_up_at_the_join_timeout():
    store, tally = counted(dist.HashStore())
    enter(store, 1, 0)
    clock = FakeClock()
    with pytest.raises(ReplacementFailed, match="did not join within 30s"):
        await_members(store, 1, 2, 30.0, judge=False, clock=clock)
    assert 30.0 < clock.now < 30.0 + POLL_S + ENTERED_POLL_S
    looks = tally.calls["add", "genN/entered"]
    assert looks >= 30.0 / ENTERED_POLL_S and tally.calls["check", "genN/members_failed"] \
        <= 30.0 / POLL_S + 2
    assert sum(tally.keys.values()) == sum(tally.calls.values())  # one key a read


def test_a_replacement_joins_the_generation_after_the_one_its_predecessor_was_in():
    store = JobStore(dist.HashStore())
    for rank in range(2):
        enter(store, 3, rank)  # rank 1's lost process was in 3: the others form 4 once they see it
    assert generation_to_join(store, 1, 1.0) == 4
    store.store.set("generation", "4")  # they formed it already
    assert generation_to_join(store, 1, 1.0) == 4


# --- where each rank's state comes from --------------------------------------------------

GROUPS = [[0, 2], [1, 3]]  # pp=2 dp=2: the data-parallel groups


def test_a_process_lost_in_its_generations_setup_is_not_replaced():
    """Its peers may wait for it in a process group's formation, which no
    abort can end: a relaunch frees them. Lost after its setup, or before
    it entered any generation (its predecessor's record is the newest), it
    is replaced."""
    store = JobStore(dist.HashStore())
    assert not lost_in_setup(store, 1, 111)  # nothing entered yet: the first start
    set_pid(store, 0, 1, 111)
    store.store.set("generation", "0")
    assert lost_in_setup(store, 1, 111)
    set_up(store, 0, 1)
    assert not lost_in_setup(store, 1, 111)
    set_pid(store, 1, 1, 111)  # the next generation, entered, not set up
    store.store.set("generation", "1")
    assert lost_in_setup(store, 1, 111)
    assert not lost_in_setup(store, 1, 222)  # a replacement that never entered one


def carrying(*steps):
    """What each rank carries: a state at each step (None: nothing), one sum."""
    return [None if s is None else Held(s, 100, 7) for s in steps]


def test_a_replacement_takes_its_state_from_a_peer_of_its_group():
    plan = live_plan(carrying(4, 4, 4, None), GROUPS, replicated=True)
    assert plan.step == 4 and plan.sources == {0: 0, 1: 1, 2: 2, 3: 1}


def test_ranks_one_step_behind_catch_up_from_a_peer_at_the_newest_step():
    """A peer died after a step's last collective: some ranks applied the
    update, others had not; every rank goes on from the newest step."""
    plan = live_plan(carrying(5, 4, 5, 5), GROUPS, replicated=True)
    assert plan.step == 5 and plan.sources == {0: 0, 2: 2, 1: 3, 3: 3}


def test_a_group_with_no_rank_at_the_newest_step_sends_the_job_to_the_checkpoints():
    plan = live_plan(carrying(5, 4, 5, None), GROUPS, replicated=True)
    assert plan.step is None
    assert plan.why_not.startswith("no live rank holds rank(s) [1, 3]'s state at step 5")


def test_no_peer_at_dp_1_or_unreplicated_optimizer_state_says_why():
    assert "dp = 1" in live_plan(carrying(4, None), [[0], [1]], replicated=True).why_not
    plan = live_plan(carrying(4, None), [[0, 1]], replicated=False, why_unreplicated="sharded here")
    assert plan.step is None and plan.why_not.endswith("sharded here")


def test_no_rank_carrying_state_is_an_ordinary_start():
    plan = live_plan(carrying(None, None), [[0, 1]], replicated=True)
    assert plan.step is None and plan.why_not == ""


# --- a donor's proof (the replica check runs: prove=True) ---------------------------------
# Held(step, bytes, digest, agreed): agreed is the (step, digest) its replicas last agreed on.

def test_a_donor_proves_its_state_with_the_sum_its_replicas_agreed_on():
    plan = live_plan([None, Held(5, 100, 7, (5, 7))], [[0, 1]], replicated=True, prove=True)
    assert plan.step == 5 and plan.sources == {0: 1, 1: 1}
    assert plan.agreement(0) == plan.agreement(1) and plan.agreement(0).digest == 7
    assert plan.corrupted == []


def test_a_donor_changed_since_its_replicas_agreed_is_corrupted_and_not_copied():
    """The issue's case at check_interval=1: a bit flipped at rest after the
    check; copying it would leave both replicas agreeing on it."""
    plan = live_plan([None, Held(5, 100, 9, (5, 7))], [[0, 1]], replicated=True, prove=True)
    assert plan.step is None and plan.corrupted == [1] and plan.newest == 5
    assert plan.why_not.startswith("no live rank holds a proven copy of rank(s) [0, 1]'s state "
                                   "at step 5: rank 1's copy differs from the one its replicas "
                                   "agreed on at that step (silent data corruption since)")


def test_a_donor_newer_than_its_replicas_agreement_cannot_prove_it_at_dp_2():
    """The issue's case: the flip came after the last check (check_interval
    > 1), the kill before the next one: nothing can tell the state is sound."""
    plan = live_plan([None, Held(5, 100, 9, (4, 7))], [[0, 1]], replicated=True, prove=True)
    assert plan.step is None and plan.corrupted == []
    assert "rank 1's copy cannot be proven (its replicas last agreed at step 4" in plan.why_not
    assert "resilience.numerics.check_interval=1" in plan.why_not
    never = live_plan([None, Held(5, 100, 9)], [[0, 1]], replicated=True, prove=True)
    assert "no replica check passed in this generation" in never.why_not


def test_unchecked_replicas_donate_as_ever():
    """resilience.numerics.check_interval=0: nothing checks the replicas, so
    nothing proves a donor either (docs/numerics.md)."""
    plan = live_plan([None, Held(5, 100, 9, (4, 7))], [[0, 1]], replicated=True, prove=False)
    assert plan.step == 5 and plan.sources == {0: 1, 1: 1} and plan.proven == {}


def test_survivors_that_agree_now_prove_a_state_newer_than_the_agreement():
    plan = live_plan([None, Held(5, 100, 9, (4, 7)), Held(5, 100, 9, (4, 7))], [[0, 1, 2]],
                     replicated=True, prove=True)
    assert plan.step == 5 and plan.sources == {0: 1, 1: 1, 2: 2} and plan.agreement(0).digest == 9


def test_survivors_that_differ_with_no_agreement_to_tell_send_the_job_to_the_checkpoints():
    plan = live_plan([None, Held(5, 100, 9, (4, 7)), Held(5, 100, 8, (4, 7))], [[0, 1, 2]],
                     replicated=True, prove=True)
    assert plan.step is None and plan.corrupted == []
    assert "the copies on ranks [1, 2] differ" in plan.why_not


def test_the_agreed_sum_tells_which_survivor_is_corrupted_and_it_takes_the_proven_state():
    plan = live_plan([None, Held(5, 100, 8, (5, 7)), Held(5, 100, 7, (5, 7))], [[0, 1, 2]],
                     replicated=True, prove=True)
    assert plan.step == 5 and plan.sources == {0: 2, 1: 2, 2: 2} and plan.corrupted == [1]


def test_a_majority_of_survivors_outvotes_a_corrupted_one():
    """Before any donates, the survivors agree (dp = 4): the odd one out
    takes the majority's state as the lost rank does."""
    held = [None, Held(5, 100, 9, (4, 7)), Held(5, 100, 9, (4, 7)), Held(5, 100, 8, (4, 7))]
    plan = live_plan(held, [[0, 1, 2, 3]], replicated=True, prove=True)
    assert plan.sources == {0: 1, 1: 1, 2: 2, 3: 1} and plan.corrupted == [3]


def test_a_group_with_nothing_to_move_keeps_its_own_unproven_states():
    """Ranks 1 and 3 lost no replica: what they hold is not copied anywhere,
    and the replica check compares them at its next step as ever."""
    held = [None, Held(5, 100, 1, (4, 7)), Held(5, 100, 7, (5, 7)), Held(5, 100, 2, (4, 7))]
    plan = live_plan(held, GROUPS, replicated=True, prove=True)
    assert plan.step == 5 and plan.sources == {0: 2, 2: 2, 1: 1, 3: 3}
    assert plan.agreement(0).digest == 7 and plan.agreement(1) is None


def test_a_survivor_still_stuck_in_the_old_generation_is_waited_for():
    """Rank 1 lost no process: it is stuck in a collective of generation 0
    whose peers left (freed at its time limit), its heartbeat still beating.
    Without a replacement on the way it is waited for, not given up on."""
    store, clock = JobStore(dist.HashStore()), FakeClock()
    set_pid(store, 0, 1, 4242)
    enter(store, 1, 0)
    beats = iter(range(10_000))

    def meanwhile() -> None:
        store.store.set("hb/0/1", json.dumps({"beat": next(beats)}))
        if clock.now > 12.0:  # its collective timed out: it enters
            enter(store, 1, 1)

    clock.on_sleep = meanwhile
    await_members(store, 1, 2, 120.0, clock=clock)
    assert 12.0 < clock.now < 13.0


def test_a_rank_told_to_stop_stops_waiting():
    store, clock = JobStore(dist.HashStore()), FakeClock()
    enter(store, 1, 0)
    with pytest.raises(ReplacementFailed, match="told to stop"):
        await_members(store, 1, 2, 120.0, stopping=lambda: clock.now > 1.0, clock=clock)


def test_the_wait_ends_within_a_count_poll_of_the_last_rank_entering():
    """The ranks entered are counted: the wait ends ENTERED_POLL_S after the
    last one enters, not at the next look at who is missing (POLL_S)."""
    store, clock = JobStore(dist.HashStore()), FakeClock()
    enter(store, 1, 0)

    def meanwhile() -> None:
        if 0.13 < clock.now < 0.14:
            enter(store, 1, 1)

    clock.on_sleep = meanwhile
    await_members(store, 1, 2, 60.0, clock=clock)
    assert 0.13 < clock.now <= 0.14 + ENTERED_POLL_S


def test_a_rank_entered_twice_does_not_stand_in_for_a_missing_one():
    store, clock = JobStore(dist.HashStore()), FakeClock()
    set_pid(store, 0, 1, 4242)
    announce_replacement(store, 4242, 4343)
    enter(store, 1, 0)
    enter(store, 1, 0)  # the count is 2 of 2, rank 1 is still missing

    def meanwhile() -> None:
        if clock.now > 3.0:
            enter(store, 1, 1)

    clock.on_sleep = meanwhile
    await_members(store, 1, 2, 60.0, clock=clock)
    assert 3.0 < clock.now < 3.0 + 2 * ENTERED_POLL_S


def test_missing_members_are_found_by_halves_not_one_check_per_rank():
    checks = []

    class CountingHashStore(dist.HashStore):
        def check(self, keys):
            checks.append(len(keys))
            return super().check(keys)

    store = JobStore(CountingHashStore())
    for rank in range(64):
        if rank not in (0, 17, 63):
            enter(store, 1, rank)
    assert store.missing_members(1, list(range(64))) == [0, 17, 63]
    assert len(checks) <= 3 * 2 * 6 + 1  # at most 2 log2(64) per missing rank, and the first
    checks.clear()
    for rank in (0, 17, 63):
        enter(store, 1, rank)
    assert store.missing_members(1, list(range(64))) == [] and checks == [64]
    checks.clear()
    store.store.delete_key("gen1/pid/40")
    assert store.missing_members(1, list(range(64))) == [40]
    # The half after a passing one goes unchecked: 11 checks, not 13 (nor 64).
    assert checks == [64, 32, 16, 8, 4, 2, 1, 1, 2, 4, 16]


def test_a_lost_rank_among_many_is_named_when_nobody_replaces_it():
    store, clock = JobStore(dist.HashStore()), FakeClock()
    set_pid(store, 0, 37, 4242)
    for rank in range(64):
        if rank != 37:
            enter(store, 1, rank)
    with pytest.raises(ReplacementFailed, match=r"no replacement was started for rank\(s\) \[37\]"):
        await_members(store, 1, 64, 120.0, clock=clock)
