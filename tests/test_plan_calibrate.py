"""The planner's fitted knobs: the per-layer overhead term of the estimate and the fit ``plan --calibrate`` makes
(no measurement here: the fit is checked on times made by a formula); the inter-node link calibration."""
import ast
import json
import pathlib
import re
import time

import numpy as np
import pytest

import mpidist
from mpidist.plan import Layout, ModelShape, Profile, estimate, load_profile
from mpidist.plan.profile import Tier
from mpidist.plan.calibrate import (PINGPONG_SIZES, TP_RANK_RUNS, calibrate_inter, fit_alpha_beta, fit_knobs,
                                    fit_microbatch_cost, fit_oversubscribed, fit_replicated_terms, fit_tp_replicated,
                                    with_inter_tier)
from mpidist.plan.estimate import collective_seconds, touched_bytes

SHAPE = ModelShape(layers=3, hidden=32, heads=4, vocab=64, seq=8)


MEASURED_TERMS = ("microbatch_cost", "tp_replicated_s", "sp_replicated_s", "oversubscribed_tier",
                  "oversubscribed_groups")


def _profile(**knobs):
    """The shipped local profile with ``knobs``, without the CPU terms ``--calibrate`` measures beyond the two
    knobs (each test sets the ones it is about): the formulas below are each term's alone."""
    base = {k: v for k, v in load_profile("local").to_dict().items() if k not in MEASURED_TERMS}
    return Profile.from_dict(dict(base, **knobs))


@pytest.mark.parametrize("layout,ranks_per_node,cores", [
    (Layout(1, 1, 1, micro_batch=2, num_micro=3), 1, 2),
    (Layout(1, 2, 1, micro_batch=4), 2, 2),                        # tp: every rank runs all the ops
    (Layout(4, 1, 1, micro_batch=1, num_micro=2), 4, 2),           # 4 ranks on 2 cores: twice the time
    (Layout(2, 1, 1, micro_batch=2, recompute="full"), 2, 2)])     # recompute: the blocks' forward again
def test_layer_overhead_adds_layers_times_micro_batches(layout, ranks_per_node, cores):
    """compute(o) - compute(0) = num_micro x (L + 2 + recomputed blocks / 3) x o x max(1, ranks / cores)."""
    overhead = 1e-3
    base = estimate(SHAPE, layout, _profile(cores_per_node=cores, layer_overhead_s=0.0), ranks_per_node).time
    more = estimate(SHAPE, layout, _profile(cores_per_node=cores, layer_overhead_s=overhead), ranks_per_node).time
    passes = SHAPE.layers + 2 + (SHAPE.layers / 3 if layout.recompute == "full" else 0)
    share = max(1.0, ranks_per_node / cores)
    assert more["compute"] - base["compute"] == pytest.approx(layout.num_micro * passes * overhead * share)
    for part in ("tp", "optimizer"):
        assert more[part] == base[part]
    assert more["dp"] <= base["dp"]   # a longer backward hides more of the data-parallel reduction


def test_layer_overhead_goes_into_the_pipeline_simulation():
    """A 2-stage 1F1B pipeline: each stage carries its own layers' overhead, so the step grows by at least the
    busiest stage's share and at most the whole model's."""
    layout = Layout(1, 1, 2, micro_batch=1, num_micro=4, schedule="1f1b")
    base = estimate(SHAPE, layout, _profile(layer_overhead_s=0.0), 2).time["step"]
    more = estimate(SHAPE, layout, _profile(layer_overhead_s=1e-3), 2).time["step"]
    stage = 3   # 5 layers (embed, 3 blocks, head) over 2 stages: the larger holds 3
    assert 4 * stage * 1e-3 <= more - base <= 4 * 5 * 1e-3 + 1e-12


def test_profile_keeps_the_overhead_knob():
    profile = _profile(layer_overhead_s=2.5e-4)
    assert profile.layer_overhead_s == 2.5e-4
    assert Profile.from_dict(profile.to_dict()).layer_overhead_s == 2.5e-4
    assert Profile.from_dict({k: v for k, v in profile.to_dict().items() if k != "layer_overhead_s"}
                             ).layer_overhead_s == 0.0


def test_fit_knobs_recovers_the_formula():
    """Times made as scale x modelled + overhead x passes give back scale and overhead."""
    modelled = np.array([0.002, 0.011, 0.004, 0.03])
    passes = np.array([4, 4, 4, 8])
    measured = 2.5 * modelled + 7e-4 * passes
    scale, overhead = fit_knobs(modelled, passes, measured)
    assert scale == pytest.approx(2.5, rel=1e-9)
    assert overhead == pytest.approx(7e-4, rel=1e-9)


def test_fit_knobs_without_a_fixed_cost_fits_the_scale_alone():
    """Times shorter than the scale allows at small sizes would need a negative overhead: it is 0, and the scale
    is the relative least-squares one, sum(r) / sum(r^2) with r = modelled / measured."""
    modelled = np.array([0.01, 0.02])
    passes = np.array([4, 4])
    measured = np.array([0.01, 0.05])   # 1x at the small run, 2.5x at the large: no positive fixed cost fits
    scale, overhead = fit_knobs(modelled, passes, measured)
    r = modelled / measured
    assert overhead == 0.0
    assert scale == pytest.approx(r.sum() / (r ** 2).sum())


def test_fit_knobs_refuses_too_few_or_bad_runs():
    with pytest.raises(ValueError, match=r"fit_knobs: needs >= 2 runs with positive times"):
        fit_knobs([0.01], [4], [0.02])
    with pytest.raises(ValueError, match=r"fit_knobs: needs >= 2 runs with positive times"):
        fit_knobs([0.01, 0.02], [4, 4], [0.02, 0.0])


@pytest.mark.parametrize("layout,ranks_per_node,cores,passes", [
    (Layout(1, 2, 1, micro_batch=4), 2, 2, 1.0),
    (Layout(1, 4, 1, micro_batch=2, num_micro=3), 4, 4, 1.0),
    (Layout(1, 4, 1, micro_batch=2, num_micro=3, sequence_parallel=True), 4, 4, 1.0),
    (Layout(2, 2, 1, micro_batch=2, recompute="full"), 4, 4, 4 / 3),   # the blocks' forward again
    (Layout(1, 4, 1, micro_batch=2), 4, 2, 1.0)])                       # 4 ranks on 2 cores: twice the time
def test_tp_replicated_charges_each_blocks_whole_sequence_elements(layout, ranks_per_node, cores, passes):
    """compute(c) - compute(0) = num_micro x layers x b x seq x hidden x (1 - 1/tp) x c x passes x max(1, ranks /
    cores), c the profile's number for the layout's mode (``sp_replicated_s`` under sequence parallelism, else
    ``tp_replicated_s``; the other one changes nothing); nothing else moves."""
    mine, other = ("sp_replicated_s", "tp_replicated_s") if layout.sequence_parallel else (
        "tp_replicated_s", "sp_replicated_s")
    c = 3e-8
    base = estimate(SHAPE, layout, _profile(cores_per_node=cores, **{other: 1e-6}), ranks_per_node).time
    more = estimate(SHAPE, layout, _profile(cores_per_node=cores, **{mine: c, other: 1e-6}), ranks_per_node).time
    elements = layout.num_micro * SHAPE.layers * layout.micro_batch * SHAPE.seq * SHAPE.hidden * (1 - 1 / layout.tp)
    share = max(1.0, ranks_per_node / cores)
    assert more["compute"] - base["compute"] == pytest.approx(elements * c * passes * share, rel=1e-9)
    for part in ("tp", "optimizer"):
        assert more[part] == base[part]
    assert base == estimate(SHAPE, layout, _profile(cores_per_node=cores), ranks_per_node).time


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("interleaved", 2)])
def test_tp_replicated_charges_a_pipeline_stage_its_own_blocks(schedule, chunks):
    """tp2 x pp2, 4 layers: each stage holds 2 blocks (in 1 or 2 chunks), so a step's compute (its busiest
    stage's) grows by num_micro x 2 blocks' elements x c, not the whole model's 4."""
    shape = ModelShape(layers=4, hidden=32, heads=4, vocab=64, seq=8)
    layout = Layout(1, 2, 2, micro_batch=2, num_micro=4, schedule=schedule, chunks=chunks)
    c = 3e-8
    base = estimate(shape, layout, _profile(cores_per_node=4), 4).time
    more = estimate(shape, layout, _profile(cores_per_node=4, tp_replicated_s=c), 4).time
    assert more["compute"] - base["compute"] == pytest.approx(4 * 2 * 2 * 8 * 32 * (1 - 1 / 2) * c, rel=1e-9)
    assert more["step"] > base["step"] and more["tp"] == base["tp"]


def test_tp_replicated_is_nothing_without_tensor_parallelism():
    layout = Layout(2, 1, 1, micro_batch=4)
    base = estimate(SHAPE, layout, _profile(), layout.ranks).time
    assert estimate(SHAPE, layout, _profile(tp_replicated_s=1e-6, sp_replicated_s=1e-6), layout.ranks).time == base


def test_fit_tp_replicated_recovers_the_seconds():
    """Times made as modelled + c x elements give back c; runs the model already over-prices give 0 (no negative
    cost); bad runs are refused with the values."""
    modelled, elements = np.array([0.01, 0.02, 0.012]), np.array([6.5e4, 1.3e5, 1e5])
    assert fit_tp_replicated(modelled, elements, modelled + 2e-8 * elements) == pytest.approx(2e-8, rel=1e-9)
    assert fit_tp_replicated(modelled, elements, modelled * 0.9) == 0.0
    with pytest.raises(ValueError, match=r"fit_tp_replicated: needs >= 1 run with positive times and elements "
                                         r"\(elements=\[0.0\], measured=\[0.01\]\)"):
        fit_tp_replicated([0.01], [0.0], [0.01])


def test_tp_replicated_fit_is_the_estimates_own_term():
    """Times made by the estimate with known numbers on the declared tensor-parallel runs (one rank alone, its
    collectives local: compute and optimizer only) give back each number through ``fit_replicated_terms``, from its own
    runs (without, with sequence parallelism)."""
    data = _profile(cores_per_node=2, layer_overhead_s=4e-4).to_dict()
    truth = Profile.from_dict(dict(data, tp_replicated_s=2.2e-8, sp_replicated_s=3.1e-8, cores_per_node=None))
    measured = []
    for dims, tp, batch, sp in TP_RANK_RUNS:
        timing = estimate(ModelShape(**dims), Layout(1, tp, 1, micro_batch=batch, sequence_parallel=sp), truth, tp).time
        measured.append(timing["compute"] + timing["optimizer"])
    fitted, record = fit_replicated_terms(data, measured)
    assert fitted == pytest.approx({"tp_replicated_s": 2.2e-8, "sp_replicated_s": 3.1e-8}, rel=1e-9)
    assert max(abs(e) for e in record["fit_errors"]) < 1e-9
    assert {(r["tp"], r["sequence_parallel"]) for r in record["runs"]} == {(2, False), (4, False), (2, True), (4, True)}


def test_calibration_steps_report_the_tensor_parallel_runs_in_order(monkeypatch, capsys):
    """``_steps`` times every declared run once, interleaved, and reports them by part: the one-rank runs, the
    micro-batch sweep, then ``TP_RANK_RUNS`` in their order (what ``calibrate`` reads)."""
    from mpidist.plan import calibrate
    monkeypatch.setattr(calibrate, "interleaved_medians", lambda steps: [[float(k), 0.0] for k in range(len(steps))])
    calibrate._steps()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n, m = len(calibrate.CALIBRATION_RUNS), len(calibrate.MICROBATCH_SWEEP[1])
    assert [k for k, _ in out["runs"]] == list(range(n))
    assert [k for k, _ in out["sweep"]] == list(range(n, n + m))
    assert [k for k, _ in out["tp_rank"]] == list(range(n + m, n + m + len(TP_RANK_RUNS)))


def test_tensor_parallel_runs_are_timed_without_the_stand_in_collectives():
    """A step over ``OneRankOfMany`` counts less the time its stand-in collectives took (a real transport's, which
    the planner prices by alpha-beta): a step that only runs a stand-in allreduce of 8 MiB takes about nothing."""
    from mpi4py import MPI

    from mpidist.plan.calibrate import _without_stand_ins
    from mpidist.plan.execute import OneRankOfMany
    world = OneRankOfMany(4, rank=1, splits=[2])
    group = world.Split(0, 1)   # a group split from the world: the same clock
    data = np.ones(2 << 20, dtype=np.float32)

    class Run:
        def step(self):
            began = time.perf_counter()
            group.Allreduce(MPI.IN_PLACE, data)
            return time.perf_counter() - began

    whole = Run().step()
    assert world.local_seconds > 0 and world.local_seconds == group.local_seconds
    left = _without_stand_ins(Run(), world)()
    assert -1e-3 < left < 0.1 * whole and data[0] == 4.0   # 2 (group) x 2 (again)


def test_one_rank_of_many_refuses_a_split_it_cannot_play():
    from mpidist.plan.execute import OneRankOfMany
    with pytest.raises(ValueError, match=r"an undeclared Split \(color=0, key=1\) of 4 ranks"):
        OneRankOfMany(4).Split(0, 1)
    with pytest.raises(ValueError, match=r"the declared group size 3 does not divide the 4 ranks being split"):
        OneRankOfMany(4, splits=[3]).Split(0, 1)
    world = OneRankOfMany(4, splits=[2])
    with pytest.raises(ValueError, match=r"Split takes key as the rank in the group: key 3 is not in \[0, 2\)"):
        world.Split(1, 3)
    assert world.Split(1, 1).Get_size() == 2   # the refused Split left its declaration in place


def test_profile_keeps_tp_replicated_and_refuses_a_negative_one():
    profile = _profile(tp_replicated_s=1.5e-8, sp_replicated_s=2.5e-8)
    again = Profile.from_dict(profile.to_dict())
    assert (again.tp_replicated_s, again.sp_replicated_s) == (1.5e-8, 2.5e-8)
    assert not {"tp_replicated_s", "sp_replicated_s"} & set(_profile().to_dict())   # from specifications: absent, 0
    for key in ("tp_replicated_s", "sp_replicated_s"):
        for bad in (-1e-8, "2e-8", None):
            got = re.escape(repr(bad))
            with pytest.raises(ValueError, match=rf"{key} must be a number of seconds >= 0 \(got {got}\)"):
                _profile(**{key: bad})


def test_oversubscribed_data_parallel_reduction_is_not_hidden():
    """Ranks beyond the cores: no idle core progresses the transfers, so a DDP step exposes its whole ring
    allreduce time (at or under the cores, backward hides part of it)."""
    from mpidist.plan.volumes import calls_per_rank
    layout = Layout(4, 1, 1, micro_batch=4)
    profile = _profile(cores_per_node=2)
    tier = profile.tiers["intra"]
    ring = sum(c.count * collective_seconds(c.op, c.nbytes, 4, tier.latency_s, tier.effective_bandwidth)
               for c in calls_per_rank(SHAPE, layout, 0) if c.group == "dp")
    hidden = estimate(SHAPE, layout, _profile(cores_per_node=4), 4).time["dp"]
    assert estimate(SHAPE, layout, profile, 4).time["dp"] == pytest.approx(ring)
    assert hidden < ring


def test_inter_tier_is_the_alpha_beta_line_through_the_pingpong():
    """Times made as alpha + bytes / bandwidth: the inter tier has that bandwidth, and as latency the smallest
    message's time (alpha + 8 / bandwidth: the latency is never under a measured time); the rest is the base's."""
    alpha, bandwidth = 4e-5, 2.5e7
    points = [[n, alpha + n / bandwidth] for n in PINGPONG_SIZES]
    base = load_profile("local").to_dict()
    data = with_inter_tier(base, points, ranks_per_link=2, hosts=("a", "b"), name="two-nodes")
    inter = Profile.from_dict(data).tiers["inter"]
    assert inter.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert inter.latency_s == pytest.approx(alpha + PINGPONG_SIZES[0] / bandwidth, rel=1e-6)
    assert inter.ranks_per_link == 2
    assert data["tiers"]["intra"] == base["tiers"]["intra"] and data["peak_flops"] == base["peak_flops"]
    assert data["name"] == "two-nodes" and data["fit"]["inter"]["hosts"] == ["a", "b"]
    assert base["tiers"]["inter"] != data["tiers"]["inter"]   # the base is copied, not changed


def test_fit_alpha_beta_latency_is_at_least_the_smallest_time():
    """Noise that puts the fitted intercept under zero: the latency is the smallest message's time."""
    points = [[8, 1e-5], [1 << 20, 1e-3], [1 << 22, 5e-3]]
    slope, intercept = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
    assert intercept < 0
    alpha, bandwidth = fit_alpha_beta(points)
    assert alpha == 1e-5
    assert bandwidth == pytest.approx(1 / slope)


@pytest.mark.world_sizes(2, 4)
def test_calibrate_inter_pingpongs_between_ranks_0_and_1(comm):
    """Ranks 0 and 1 on two hosts: every rank returns the same profile, its inter tier fitted to the ping-pong's
    points (one per message size, positive times) and named after the two hosts."""
    base = load_profile("local").to_dict()
    data = calibrate_inter(base, comm, ranks_per_link=2, host=f"node{comm.Get_rank()}")
    record = data["fit"]["inter"]
    assert record["hosts"] == ["node0", "node1"]
    assert [p[0] for p in record["points"]] == list(PINGPONG_SIZES)
    assert all(p[1] > 0 for p in record["points"])
    alpha, bandwidth = fit_alpha_beta(record["points"])
    assert data["tiers"]["inter"] == {"latency_s": alpha, "bandwidth": bandwidth, "efficiency": 1.0,
                                      "ranks_per_link": 2}
    assert comm.allgather(data["tiers"]["inter"]) == [data["tiers"]["inter"]] * comm.Get_size()
    assert data["multi_rail"] is False   # the base's
    told = calibrate_inter(base, comm, ranks_per_link=1, host=f"node{comm.Get_rank()}", multi_rail=True)
    assert Profile.from_dict(told).multi_rail is True
    assert told["halving_doubling_allreduce"] is False   # the job's allreduce is NCCL's, not this MPI's
    kept = calibrate_inter(load_profile("h100-ib").to_dict(), comm, host=f"node{comm.Get_rank()}")
    assert kept["multi_rail"] is True


def test_calibrate_inter_refuses_ranks_0_and_1_on_one_host(comm):
    """One rank, or ranks 0 and 1 on one host, measure no inter-node link: the same error on every rank."""
    expected = "needs 2 ranks or more" if comm.Get_size() == 1 else "ranks 0 and 1 are both on host 'same'"
    with pytest.raises(ValueError, match=rf"plan calibrate --inter: {expected}"):
        calibrate_inter(load_profile("local").to_dict(), comm, host="same")
    comm.Barrier()   # every rank got here: none is left in a ping-pong


def test_no_module_under_mpidist_imports_test_code():
    """An installed mpidist has no tests/ directory: no module imports a module of the test tree (vcluster,
    helpers, conftest, ...) or puts a tests/ path on sys.path."""
    root = pathlib.Path(mpidist.__file__).parent
    test_modules = {p.stem for p in (root.parent / "tests").rglob("*.py")} | {"tests"}
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.path.insert", "sys.path.append",
                                                                           "sys.path.extend"):
                strings = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
                if any("tests" in s for s in strings):
                    offenders.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
                continue
            else:
                continue
            if any(n.split(".")[0] in test_modules for n in names):
                offenders.append(f"{path.relative_to(root)}:{node.lineno} imports {names}")
    assert offenders == [], offenders


@pytest.mark.parametrize("layout,ranks_per_node,cores", [
    (Layout(1, 1, 1, micro_batch=2, num_micro=3), 1, 2),
    (Layout(1, 2, 1, micro_batch=4), 2, 2),
    (Layout(4, 1, 1, micro_batch=1, num_micro=2), 4, 2),
    (Layout(2, 1, 1, micro_batch=2, recompute="full"), 2, 2)])
def test_microbatch_factor_multiplies_the_arithmetic_only(layout, ranks_per_node, cores):
    """A curve interpolated in log size: at the layout's block bytes x, halfway (in log) between x / 2 (factor 1)
    and 2 x (factor 2), compute is 1.5 x the arithmetic plus the unchanged per-layer overhead. The key, x, is
    one block's formed arrays per micro-batch and rank (``touched_bytes``)."""
    x = touched_bytes(SHAPE, Layout(**{**layout.to_dict(), "recompute": "none"}), ["blocks.0"])
    curve = [[x / 2, 1.0], [2 * x, 2.0]]
    knobs = dict(cores_per_node=cores, layer_overhead_s=1e-3)
    arithmetic = estimate(SHAPE, layout, _profile(**dict(knobs, layer_overhead_s=0.0)), ranks_per_node).time
    plain = estimate(SHAPE, layout, _profile(**knobs), ranks_per_node).time
    curved = estimate(SHAPE, layout, _profile(microbatch_cost=curve, **knobs), ranks_per_node).time
    assert curved["compute"] - plain["compute"] == pytest.approx(0.5 * arithmetic["compute"])
    assert curved["tp"] == plain["tp"] and curved["optimizer"] == plain["optimizer"]


def test_microbatch_factor_is_clamped_at_the_curve_ends():
    profile = _profile(microbatch_cost=[[1e3, 0.8], [1e6, 1.3]])
    assert profile.microbatch_factor(10.0) == 0.8
    assert profile.microbatch_factor(1e9) == 1.3
    assert profile.microbatch_factor(10 ** 4.5) == pytest.approx(0.8 + 0.5 * 0.5)
    assert Profile.from_dict(dict(_profile().to_dict(), microbatch_cost=[])).microbatch_factor(1e5) == 1.0


def test_profile_keeps_the_microbatch_curve_and_the_oversubscribed_tier():
    over = {"latency_s": 1e-4, "bandwidth": 2e8}
    profile = _profile(microbatch_cost=[[1e3, 0.8], [1e6, 1.3]], oversubscribed_tier=over)
    again = Profile.from_dict(profile.to_dict())
    assert again.microbatch_cost == ((1e3, 0.8), (1e6, 1.3))
    assert (again.oversubscribed_tier.latency_s, again.oversubscribed_tier.bandwidth) == (1e-4, 2e8)
    with pytest.raises(ValueError, match=r"microbatch_cost must be \[\[activation_bytes, factor > 0\]"):
        _profile(microbatch_cost=[[1e6, 1.0], [1e3, 1.0]])
    with pytest.raises(ValueError, match=r"microbatch_cost must be"):
        _profile(microbatch_cost=[[1e3, 0.0]])
    with pytest.raises(ValueError, match=r"oversubscribed_tier needs latency_s >= 0 and bandwidth > 0"):
        _profile(oversubscribed_tier={"latency_s": 1e-4, "bandwidth": 0})


def test_fit_microbatch_cost_recovers_the_factors():
    """Times made as factor x arithmetic + rest give back each run's factor; a run whose time is all rest gets
    the floor."""
    sizes, arithmetic, rest = [1e4, 4e4, 1.6e5], np.array([1e-3, 4e-3, 1.6e-2]), np.array([5e-3, 5e-3, 6e-3])
    factors = np.array([0.9, 1.0, 1.25])
    curve = fit_microbatch_cost(sizes, arithmetic, rest, factors * arithmetic + rest)
    assert [c[0] for c in curve] == sizes
    assert [c[1] for c in curve] == pytest.approx(list(factors))
    assert fit_microbatch_cost([1.0], [1e-3], [5e-3], [4e-3]) == [[1.0, 0.05]]
    with pytest.raises(ValueError, match=r"fit_microbatch_cost: needs runs of increasing sizes"):
        fit_microbatch_cost([2.0, 1.0], [1e-3, 1e-3], [0, 0], [1e-3, 1e-3])


_INTRA = load_profile("local").tiers["intra"]
OVER = {"latency_s": 10 * _INTRA.latency_s, "bandwidth": _INTRA.effective_bandwidth / 10}   # a slower link


def _ring(calls, layout, groups, latency, bandwidth):
    from mpidist.plan.estimate import _group_size
    return sum(c.count * collective_seconds(c.op, c.nbytes, _group_size(layout, c.group), latency, bandwidth)
               for c in calls if c.group in groups)


@pytest.mark.parametrize("layout", [Layout(4, 1, 1, micro_batch=4), Layout(4, 1, 1, "fsdp", micro_batch=4),
                                    Layout(2, 2, 1, micro_batch=8), Layout(1, 4, 1, micro_batch=16)])
def test_oversubscribed_calls_run_on_the_oversubscribed_tier(layout):
    """Ranks beyond the cores: the tensor- and data-parallel calls take the ring time on the measured
    oversubscribed link (alpha-beta) instead of the intra tier's; at or under the cores nothing changes."""
    from mpidist.plan.volumes import calls_per_rank
    calls = calls_per_rank(SHAPE, layout, 0)
    intra = _profile().tiers["intra"]
    slower = (_ring(calls, layout, {"tp", "dp"}, OVER["latency_s"], OVER["bandwidth"])
              - _ring(calls, layout, {"tp", "dp"}, intra.latency_s, intra.effective_bandwidth))
    base = estimate(SHAPE, layout, _profile(cores_per_node=2), 4).time["step"]
    over = estimate(SHAPE, layout, _profile(cores_per_node=2, oversubscribed_tier=OVER), 4).time["step"]
    assert slower > 0
    assert over - base == pytest.approx(slower)
    assert estimate(SHAPE, layout, _profile(cores_per_node=4, oversubscribed_tier=OVER), 4).time == \
        estimate(SHAPE, layout, _profile(cores_per_node=4), 4).time


def test_oversubscribed_pipeline_messages_are_slower():
    """A 4-stage 1F1B pipeline, 4 ranks on 2 cores: its messages between stages take the oversubscribed link;
    the step grows by at least the first micro-batch's way there and back (2 x 3 messages' extra time) and at
    most by every message's."""
    layout = Layout(1, 1, 4, micro_batch=1, num_micro=4, schedule="1f1b")
    intra = _profile().tiers["intra"]
    nbytes = 1 * SHAPE.seq * SHAPE.hidden * 4   # one micro-batch's activation (or its gradient)
    extra = (collective_seconds("send", nbytes, 2, OVER["latency_s"], OVER["bandwidth"])
             - collective_seconds("send", nbytes, 2, intra.latency_s, intra.effective_bandwidth))
    base = estimate(SHAPE, layout, _profile(cores_per_node=2), 4).time["step"]
    over = estimate(SHAPE, layout, _profile(cores_per_node=2, oversubscribed_tier=OVER), 4).time["step"]
    assert 6 * extra * (1 - 1e-9) <= over - base <= 2 * 3 * 4 * extra * (1 + 1e-9)


PAIR = {"latency_s": 30 * _INTRA.latency_s, "bandwidth": _INTRA.effective_bandwidth / 20}   # pairs: slower still


@pytest.mark.parametrize("layout,pair_groups", [
    (Layout(2, 2, 1, micro_batch=8), {"tp", "dp"}),                           # tp pairs and dp pairs
    (Layout(1, 4, 1, micro_batch=16), set()),                                # one group of 4: not a pair
    (Layout(1, 2, 2, micro_batch=4, num_micro=4, schedule="1f1b"), {"tp"})])   # tp pairs (the pipeline's below)
def test_oversubscribed_calls_take_their_group_sizes_link(layout, pair_groups):
    """A profile that measured pairs apart (``oversubscribed_groups``): a call over a pair takes the ring time on
    the pairs' link, a call over 4 ranks the ``oversubscribed_tier`` (no entry for 4); the step moves by exactly
    what the pairs' link adds over the all-ranks one."""
    from mpidist.plan.volumes import calls_per_rank
    calls = calls_per_rank(SHAPE, layout, 0)
    with_pairs = _profile(cores_per_node=2, oversubscribed_tier=OVER, oversubscribed_groups={"2": PAIR})
    assert with_pairs.oversubscribed_link(2) == Tier(PAIR["latency_s"], PAIR["bandwidth"])
    assert with_pairs.oversubscribed_link(4) == Tier(OVER["latency_s"], OVER["bandwidth"])
    assert _profile(cores_per_node=2).oversubscribed_link(2) is None
    base = estimate(SHAPE, layout, _profile(cores_per_node=2, oversubscribed_tier=OVER), 4).time
    paired = estimate(SHAPE, layout, with_pairs, 4).time
    for group in ("tp", "dp"):
        expected = (_ring(calls, layout, {group}, PAIR["latency_s"], PAIR["bandwidth"])
                    - _ring(calls, layout, {group}, OVER["latency_s"], OVER["bandwidth"])) if group in pair_groups else 0
        if layout.pp == 1:
            assert paired[group] - base[group] == pytest.approx(expected, abs=1e-15)
        elif group == "tp":   # a pipeline's tp calls go into its stages' F and B: the step grows by more
            assert expected > 0 and paired["step"] - base["step"] >= expected * (1 - 1e-9)
    assert (paired["tp"] > base["tp"]) == ("tp" in pair_groups)


def test_oversubscribed_pipeline_messages_take_the_pairs_link():
    """A point-to-point message between pipeline stages is a pair's: it takes the pairs' measured link."""
    layout = Layout(1, 1, 4, micro_batch=1, num_micro=4, schedule="1f1b")
    nbytes = 1 * SHAPE.seq * SHAPE.hidden * 4
    extra = (collective_seconds("send", nbytes, 2, PAIR["latency_s"], PAIR["bandwidth"])
             - collective_seconds("send", nbytes, 2, OVER["latency_s"], OVER["bandwidth"]))
    base = estimate(SHAPE, layout, _profile(cores_per_node=2, oversubscribed_tier=OVER), 4).time["step"]
    paired = estimate(SHAPE, layout, _profile(cores_per_node=2, oversubscribed_tier=OVER,
                                              oversubscribed_groups={"2": PAIR}), 4).time["step"]
    assert extra > 0 and 6 * extra * (1 - 1e-9) <= paired - base <= 2 * 3 * 4 * extra * (1 + 1e-9)


def test_profile_keeps_the_oversubscribed_groups_and_refuses_bad_ones():
    profile = _profile(oversubscribed_tier=OVER, oversubscribed_groups={"2": PAIR})
    again = Profile.from_dict(profile.to_dict())
    assert again.oversubscribed_groups == ((2, Tier(PAIR["latency_s"], PAIR["bandwidth"])),)
    assert "oversubscribed_groups" not in _profile().to_dict()   # profiles without it are written as before
    for bad, message in (({"1": PAIR}, r"oversubscribed_groups keys are group sizes >= 2 written as integers "
                                        r"\(got '1'\)"),
                         ({"pairs": PAIR}, r"keys are group sizes >= 2 written as integers \(got 'pairs'\)"),
                         ({"2": {"latency_s": -1.0, "bandwidth": 1e9}},
                          r"oversubscribed_groups\[2\] needs latency_s >= 0 and bandwidth > 0 \(got .*-1.0"),
                         ({"2": {"latency_s": 1e-5}}, r"oversubscribed_groups\[2\] needs latency_s >= 0"),
                         ({"\u00b2": PAIR}, r"keys are group sizes >= 2 written as integers \(got '\u00b2'\)"),
                         ({"02": PAIR}, r"keys are group sizes >= 2 written as integers \(got '02'\)"),
                         ({"2": PAIR, 2: OVER}, r"oversubscribed_groups has group size 2 twice \(keys \['2', '2'\]\)"),
                         ([PAIR], r"oversubscribed_groups must be \{group size")):
        with pytest.raises(ValueError, match=message):
            _profile(oversubscribed_groups=bad)


class _SplitSpy:
    """A communicator that records the members of each communicator its ``Split`` returns (every rank's)."""

    def __init__(self, comm):
        self._comm, self.groups = comm, []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Split(self, color, key=0):
        group = self._comm.Split(color, key)
        self.groups.append(group.allgather(self._comm.Get_rank()))
        return group


def test_measure_oversubscribed_times_each_group_size():
    """On the simulated communicator (4 ranks): one series per group size, pairs of consecutive ranks and all 4
    (as tensor-parallel groups are laid out), each of the sizes asked for, seconds >= 0."""
    from mpidist import simulate
    from mpidist.plan.calibrate import measure_oversubscribed

    def run(comm):
        spy = _SplitSpy(comm)
        result = measure_oversubscribed(spy, sizes=(8,), iterations=1, segment_flops=1e5, tries=1,
                                        stream_bytes=1 << 12)
        return result, spy.groups
    for rank, (result, groups) in enumerate(simulate(4, run)):
        assert sorted(result) == ["2", "4"]
        assert all([p[0] for p in points] == [8] and all(p[1] >= 0 for p in points)
                   for points in result.values())
        assert groups == [[rank // 2 * 2, rank // 2 * 2 + 1], [0, 1, 2, 3]]


@pytest.mark.parametrize("groups", [(2, 3), (1, 4), (8,), (2.0,)])
def test_measure_oversubscribed_refuses_group_sizes_it_cannot_form(groups):
    """Group sizes asked for that do not divide the ranks (or are under 2, over them, not integers): a clear
    error on every rank, before any timing."""
    from mpidist import simulate
    from mpidist.plan.calibrate import measure_oversubscribed

    def run(comm):
        with pytest.raises(ValueError, match=r"measure_oversubscribed: group sizes must be integers from 2 to the "
                                             r"4 ranks dividing them \(got \["):
            measure_oversubscribed(comm, sizes=(8,), iterations=1, segment_flops=1e5, groups=groups, tries=1)
        return True
    assert simulate(4, run) == [True] * 4


def test_oversubscribed_entries_are_the_all_ranks_tier_and_the_other_sizes():
    """Times made by the ring formula with one (alpha, bandwidth) for pairs and another for all 4 ranks: the
    profile entries give back each, the 4-rank one as ``oversubscribed_tier``, and load as a profile."""
    from mpidist.plan.calibrate import oversubscribed_entries
    sizes = (8, 1 << 16, 1 << 18, 1 << 20)
    made = {"2": (3e-5, 2e9), "4": (1e-5, 1e9)}
    points = {g: [[b, collective_seconds("allreduce", b, int(g), *made[g])] for b in sizes] for g in made}
    entries, record = oversubscribed_entries(points, 4)
    assert entries["oversubscribed_tier"] == pytest.approx(dict(zip(("latency_s", "bandwidth"),
                                                                    fit_oversubscribed(points["4"], 4))))
    assert list(entries["oversubscribed_groups"]) == ["2"]
    assert entries["oversubscribed_groups"]["2"]["bandwidth"] == pytest.approx(2e9, rel=1e-6)
    assert entries["oversubscribed_tier"]["bandwidth"] == pytest.approx(1e9, rel=1e-6)
    assert record == {"ranks": 4, "allreduce_bytes_extra_s": points}
    profile = _profile(cores_per_node=2, **entries)
    assert profile.oversubscribed_link(2).bandwidth == pytest.approx(2e9, rel=1e-6)
    assert profile.oversubscribed_link(4).bandwidth == pytest.approx(1e9, rel=1e-6)
    with pytest.raises(ValueError, match=r"oversubscribed_entries: no series over all 4 ranks \(got group sizes "
                                         r"\['2'\]\)"):
        oversubscribed_entries({"2": points["2"]}, 4)


def test_fit_oversubscribed_recovers_the_ring_allreduce():
    """Times made by the ring allreduce formula at 4 ranks give back its alpha and bandwidth."""
    alpha, bandwidth = 2e-4, 3e8
    points = [[b, collective_seconds("allreduce", b, 4, alpha, bandwidth)] for b in (8, 1 << 16, 1 << 18, 1 << 20)]
    fitted = fit_oversubscribed(points, 4)
    assert fitted[0] == pytest.approx(alpha + 8 * 2 * 3 / 4 / bandwidth / 6, rel=1e-6)
    assert fitted[1] == pytest.approx(bandwidth, rel=1e-6)
    with pytest.raises(ValueError, match=r"fit_oversubscribed: needs 2 ranks or more \(got 1\)"):
        fit_oversubscribed(points, 1)



def _two_node_profile(**knobs):
    """The local profile with a slow inter tier (a node's 2 ranks share its link) and 1 core per node: ranks
    outnumber cores at 2 per node, so a data-parallel step exposes its whole reduction (nothing overlaps)."""
    data = load_profile("local").to_dict()
    data["tiers"]["inter"] = {"latency_s": 2e-5, "bandwidth": 2.5e7, "efficiency": 1.0, "ranks_per_link": 2}
    return Profile.from_dict(dict(data, cores_per_node=1, **knobs))


def test_halving_doubling_allreduce_crosses_the_link_with_a_ring_among_nodes():
    """Recursive halving then doubling, dp=4 on 2 nodes x 2 ranks: per DDP bucket of S bytes the halving's first
    step inside the node (S / 2 each way: 2 alpha_intra + S / bw_intra with the doubling's last) and its second
    across (both ranks of a node send S / 4 over the one link: 2 alpha + S / bw with the doubling's first); a ring
    over the 4 ranks moves 1.5 S over it (6 alpha + 1.5 S / bw). A group with one rank per node (dp=2 x tp=2) is
    timed alike either way."""
    from mpidist.plan.volumes import calls_per_rank
    layout = Layout(4, 1, 1, micro_batch=4)
    ring_profile, halving = _two_node_profile(), _two_node_profile(halving_doubling_allreduce=True)
    intra, (alpha, bw) = ring_profile.tiers["intra"], (2e-5, 2.5e7)
    buckets = [c.nbytes for c in calls_per_rank(SHAPE, layout, 0, 2) if c.group == "dp" for _ in range(c.count)]
    assert len(buckets) >= 1
    halved = sum(2 * intra.latency_s + s / intra.effective_bandwidth + 2 * alpha + s / bw for s in buckets)
    ring = sum(6 * alpha + 1.5 * s / bw for s in buckets)
    assert estimate(SHAPE, layout, halving, 2).time["dp"] == pytest.approx(halved, rel=1e-9)
    assert estimate(SHAPE, layout, ring_profile, 2).time["dp"] == pytest.approx(ring, rel=1e-9)
    one_per_node = Layout(2, 2, 1, micro_batch=8)
    assert estimate(SHAPE, one_per_node, halving, 2).time == estimate(SHAPE, one_per_node, ring_profile, 2).time
    assert Profile.from_dict(halving.to_dict()).halving_doubling_allreduce is True
    with pytest.raises(ValueError, match=r"halving_doubling_allreduce must be true or false \(got 'yes'\)"):
        _two_node_profile(halving_doubling_allreduce="yes")


def test_halving_doubling_allreduce_is_mpichs_unless_another_algorithm_is_chosen():
    from mpidist.plan.calibrate import halving_doubling_allreduce
    assert halving_doubling_allreduce("MPICH Version:      5.0.2\nMPICH Release date: ...", env={})
    assert not halving_doubling_allreduce("Open MPI v5.0.8, package: Open MPI ...", env={})
    assert not halving_doubling_allreduce("MPICH Version: 5.0.2", env={"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"})
    assert halving_doubling_allreduce("MPICH Version: 5.0.2", env={"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "auto"})
