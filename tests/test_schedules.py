"""Pipeline schedules checked against hand-derived orders and the textbook bubble/memory formulas; no MPI."""
import pytest

from mpidist.parallel.pipeline.schedules import (
    Action, ScheduleDeadlockError, Kind, Schedule, format_grid, gpipe, insert_comms, interleaved_1f1b, one_f_one_b,
    simulate_schedule, validate, zero_bubble_h1,
)

PS = [2, 3, 4]
MS = [1, 2, 3, 4, 5, 8]
BUILDERS = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "zb-h1": zero_bubble_h1,
    "interleaved-v2": lambda p, m: interleaved_1f1b(p, m, 2),
}
GRID = [(name, p, m) for name in BUILDERS for p in PS for m in MS]


def compute_kinds(schedule, rank):
    return "".join(a.kind.value for a in schedule.actions[rank] if a.kind.is_compute)


def test_action_repr_and_parse():
    assert str(Action(1, "F", 0)) == "1F0"
    assert str(Action(2, Kind.B, 3)) == "2B3"
    assert repr(Action(0, "W", 1)) == "0W1"
    assert [str(Action(1, k, 0)) for k in ("sF", "rF", "sB", "rB")] == ["1sF0", "1rF0", "1sB0", "1rB0"]
    assert Action.parse("12rB7") == Action(12, Kind.RECV_B, 7)
    assert Action(1, "F", 0) == Action(1, Kind.F, 0)
    with pytest.raises(ValueError, match="unknown kind 'X'"):
        Action(0, "X", 0)
    with pytest.raises(ValueError, match="cannot parse"):
        Action.parse("1Q0")


@pytest.mark.parametrize("name,p,m", GRID)
def test_valid_and_deadlock_free_with_and_without_comms(name, p, m):
    schedule = BUILDERS[name](p, m)
    executable = insert_comms(schedule)
    validate(schedule)
    validate(executable)
    # Instant communication: the explicit send/recv lists must time out exactly like the compute order.
    assert simulate_schedule(executable).makespan == pytest.approx(simulate_schedule(schedule).makespan)


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_gpipe_memory_and_bubble(p, m):
    sim = simulate_schedule(gpipe(p, m), f_cost=1.0, b_cost=2.0)
    assert sim.peak_activations == (m,) * p
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_1f1b_memory_and_bubble(p, m):
    sim = simulate_schedule(one_f_one_b(p, m), f_cost=1.0, b_cost=2.0)
    assert sim.peak_activations == tuple(min(p - i, m) for i in range(p))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_is_not_gpipe_order():
    schedule = one_f_one_b(4, 8)
    # Hand-derived: rank i warms up with 3 - i forwards, alternates F,B, then drains the backwards.
    assert compute_kinds(schedule, 0) == "FFF" + "FB" * 5 + "BBB"
    assert compute_kinds(schedule, 2) == "F" + "FB" * 7 + "B"
    assert compute_kinds(schedule, 3) == "FB" * 8
    assert [str(a) for a in schedule.actions[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]
    assert compute_kinds(gpipe(4, 8), 0) == "F" * 8 + "B" * 8


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_zero_bubble_h1_memory_and_bubble(p, m):
    zb = simulate_schedule(zero_bubble_h1(p, m), f_cost=1.0, b_cost=2.0)  # B = W = 1
    ref = simulate_schedule(one_f_one_b(p, m), f_cost=1.0, b_cost=2.0)
    # Activations released at B: exactly 1F1B's per-rank bound.
    assert all(zb.peak_activations[i] <= min(p - i, m) for i in range(p))
    # Inputs kept until W: no rank holds more than 1F1B's worst rank does.
    assert max(zb.peak_until_w) <= max(ref.peak_activations) == min(p, m)
    assert zb.busy == ref.busy == (3.0 * m,) * p
    if m >= p:
        assert zb.bubble_fraction < ref.bubble_fraction
        # Qi et al. 2023: ZB-H1 idles (p-1)(F+B-W) per rank against 1F1B's (p-1)(F+B+W), a third here.
        assert zb.makespan - 3 * m == pytest.approx((p - 1) * (1 + 1 - 1))
        assert ref.makespan - 3 * m == pytest.approx((p - 1) * (1 + 1 + 1))


def test_zero_bubble_h1_order():
    schedule = zero_bubble_h1(4, 8)
    # Hand-derived: F and B in 1F1B order; rank r runs W r backwards late, so the last rank's deferred Ws
    # land in the cool-down where 1F1B would idle.
    assert compute_kinds(schedule, 0) == "FFF" + "FBW" * 5 + "BW" * 3
    assert compute_kinds(schedule, 3) == "FB" * 3 + "FBW" * 5 + "WWW"
    assert [str(a) for a in schedule.actions[3][-4:]] == ["3W4", "3W5", "3W6", "3W7"]


@pytest.mark.parametrize("p", PS)
@pytest.mark.parametrize("m", MS)
def test_interleaved_bubble(p, m):
    v = 2
    sim = simulate_schedule(interleaved_1f1b(p, m, v), f_cost=1.0, b_cost=2.0)
    assert sim.busy == (3.0 * m * v,) * p
    # Compared quantity: bubble time / ideal compute time = (makespan - busy) / busy.
    if m % p == 0:
        assert sim.bubble_ratio == pytest.approx((p - 1) / (v * m))
    else:  # fallback order: correct, and never worse than non-interleaved 1F1B's (p-1)/m
        assert sim.bubble_ratio <= (p - 1) / m + 1e-12


def test_interleaved_places_stages_round_robin():
    schedule = interleaved_1f1b(2, 4, 2)
    assert {a.stage for a in schedule.actions[0]} == {0, 2}
    assert {a.stage for a in schedule.actions[1]} == {1, 3}
    # Megatron order on rank 0: mbs 0,1 through chunk 0, then through chunk 1 (stage 2), then mbs 2,3.
    assert [str(a) for a in schedule.actions[0][:4]] == ["0F0", "0F1", "2F0", "2F1"]


def test_insert_comms_orders_recv_before_and_send_after():
    executable = insert_comms(one_f_one_b(2, 2))
    assert [str(a) for a in executable.actions[0]] == ["0F0", "0sF0", "0F1", "0sF1", "0rB0", "0B0", "0rB1", "0B1"]
    assert [str(a) for a in executable.actions[1]] == ["1rF0", "1F0", "1B0", "1sB0", "1rF1", "1F1", "1B1", "1sB1"]


def test_format_grid_hand_derived():
    # Unit costs, 1F1B p=2 m=2: rank 1 runs 1B0 at step 2, so rank 0's 0B0 waits until step 3.
    expected = "\n".join([
        "step rank0 rank1",
        "   0 0F0",
        "   1 0F1   1F0",
        "   2       1B0",
        "   3 0B0   1F1",
        "   4       1B1",
        "   5 0B1",
    ])
    assert format_grid(one_f_one_b(2, 2)) == expected
    assert format_grid(insert_comms(one_f_one_b(2, 2))) == expected
    zb_grid = format_grid(zero_bubble_h1(4, 8))
    assert "0W7" in zb_grid and "3F0" in zb_grid and len(zb_grid.splitlines()) == 1 + 3 * 8 + 3


def test_deadlock_in_compute_order_is_reported():
    # Stage 1 wants mb 1 first, but rank 0 only forwards mb 1 after 0B0, which needs 1B0: a cycle.
    bad = Schedule("bad", 2, 2, 1, [["0F0", "0B0", "0F1", "0B1"], ["1F1", "1F0", "1B0", "1B1"]])
    validate(bad)  # every action present, in F-before-B order per stage: the cycle is only visible in time
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 waits at step 1 on 0B0; rank 1 waits at step 0 on 1F1"):
        simulate_schedule(bad)


def test_deadlock_from_swapped_comms_is_reported():
    good = insert_comms(one_f_one_b(2, 1))
    rank0 = list(good.actions[0])
    assert [str(a) for a in rank0] == ["0F0", "0sF0", "0rB0", "0B0"]
    rank0[1], rank0[2] = rank0[2], rank0[1]  # receive the gradient before sending the activation it depends on
    bad = good.replace_actions([rank0, good.actions[1]], name="swapped")
    validate(bad)
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 waits at step 1 on 0rB0; rank 1 waits at step 0 on 1rF0"):
        simulate_schedule(bad)


@pytest.mark.parametrize("rows,message", [
    ([["0F0", "0B0"], ["1F0"]], r"1B0 appears 0 times"),
    ([["0F0", "0B0"], ["1B0", "1F0"]], r"rank 1: 1B0 at step 0 comes before 1F0 at step 1"),
    ([["0F0", "0B0", "1F0"], ["1B0"]], r"rank 0: 1F0 belongs on rank 1"),
    ([["0F0", "0B0", "0F0"], ["1F0", "1B0"]], r"0F0 appears twice"),
    ([["0F0", "0B0"], ["1F0", "1B0", "1F3"]], r"1F3 is out of range"),
    ([["0F0", "0sF0", "0B0"], ["1F0", "1B0"]], r"1rF0 is missing"),
    ([["0F0", "0sF0", "0rB0", "0B0"], ["1rF0", "1F0", "1B0", "1sB0", "1sF0"]], r"1sF0 has no matching peer"),
])
def test_validate_reports_problems(rows, message):
    with pytest.raises(ValueError, match=message):
        validate(Schedule("hand", 2, 1, 1, rows))


def test_validate_requires_w_for_every_backward_when_split():
    rows = [list(r) for r in zero_bubble_h1(2, 2).actions]
    rows[0] = [a for a in rows[0] if str(a) != "0W1"]
    with pytest.raises(ValueError, match="0W1 appears 0 times"):
        validate(Schedule("zb-missing-w", 2, 2, 1, rows))


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match=r"p, m and v must be >= 1 \(p=0, m=4, v=1\)"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match="w_cost=1.0 given but schedule 1f1b has no W"):
        simulate_schedule(one_f_one_b(2, 2), w_cost=1.0)
    with pytest.raises(ValueError, match="expecting 2 action lists"):
        Schedule("short", 2, 1, 1, [["0F0", "0B0"]])
    with pytest.raises(ValueError, match="already has send/recv"):
        insert_comms(insert_comms(gpipe(2, 1)))


def test_a_schedule_deadlock_and_a_communication_deadlock_have_distinct_names():
    """One name, one meaning: the schedule simulator's error is not the simulated communicator's."""
    import mpidist
    from mpidist.parallel import pipeline

    assert pipeline.ScheduleDeadlockError is not mpidist.DeadlockError
    assert not hasattr(pipeline, "DeadlockError")
