"""Hybrid sharding (HSDP) against a single-process reference trained on the whole global batch.

With ``shard_size=k`` on 4 ranks, the 4 // k groups of k consecutive ranks each shard the model (ZeRO-3, or
ZeRO-2 for ``hybrid_shard_grad_op``) and the groups replicate each other: 2 x 2, 1 x 4 (equal to
``full_shard``) and 4 x 1 (every rank holds the whole model as one chunk, gradients allreduced across all).
The harness (model, global batches, each rank's slice, the reference step and the comparison) is
tests/test_fsdp.py's: its units have 35, 77, 156, 26 and 65 elements, uneven on 2 and 4 ranks.
"""

import contextlib
import math

import numpy as np
import pytest

import mpidist.nn as nn
from mpidist.optim import Adam
from mpidist.parallel.fsdp import FSDP, ShardingStrategy

from test_fsdp import (ITEMSIZE, UNIT_SIZES, assert_matches, batches, expected_shard, fsdp_step, make_model, my_slice,
                       padded_bytes, ref_step)

HYBRID = ["hybrid_shard", "hybrid_shard_grad_op"]
SHARD_SIZES = [2, 1, 4]  # on 4 ranks: 2 groups x 2 shards, 4 x 1, 1 x 4
MAX_NORM = 0.05  # every step of this model clips at this norm (checked)

pytestmark = pytest.mark.world_sizes(4)


def step_with_clip(comm, fsdp, opt, ref, ref_opt, x, y):
    """One step of both with clipping; return the two norms before clipping."""
    crit = nn.CrossEntropyLoss()
    crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()
    norm = fsdp.clip_grad_norm_(MAX_NORM)
    opt.step()
    opt.zero_grad()
    crit(ref(x), y).backward()
    ref_norm = nn.clip_grad_norm_(ref.parameters(), MAX_NORM)
    ref_opt.step()
    ref_opt.zero_grad()
    return norm, ref_norm


# -- parity -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shard_size", SHARD_SIZES)
@pytest.mark.parametrize("strategy", HYBRID)
def test_training_with_clipping_matches_single_process(comm, strategy, shard_size):
    ref = make_model()
    fsdp = FSDP(make_model(), comm, strategy=strategy, shard_size=shard_size)
    assert fsdp.settings.num_shards == shard_size and fsdp.settings.num_replicas == 4 // shard_size
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in batches(6):
        # Replicas hold equal reduced gradients: counting them again would give sqrt(replicas) x the norm.
        norm, ref_norm = step_with_clip(comm, fsdp, opt, ref, ref_opt, x, y)
        assert ref_norm > MAX_NORM
        assert norm == pytest.approx(ref_norm, rel=1e-12)
    assert_matches(comm, fsdp, ref)
    assert all(p.data.size == 0 for p in fsdp.module.parameters()), "full parameters must be freed at rest"


@pytest.mark.parametrize("strategy", HYBRID)
def test_given_shard_and_replicate_comms_with_strided_groups_train_like_one_process(comm, strategy):
    # Shard groups {0, 2} and {1, 3} (not consecutive): rank 0's chunk 1 lives on rank 2, so full_state_dict
    # must fetch by shard index, not by rank.
    rank = comm.Get_rank()
    shard_comm, replicate_comm = comm.Split(color=rank % 2, key=rank), comm.Split(color=rank // 2, key=rank)
    ref = make_model()
    fsdp = FSDP(make_model(), comm, strategy=strategy, shard_comm=shard_comm, replicate_comm=replicate_comm)
    assert fsdp.shard_comm is shard_comm and fsdp.replicate_comm is replicate_comm
    assert [s.shard_index for s in fsdp.shard_layout()] == [rank // 2] * 5
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in batches(4):
        norm, ref_norm = step_with_clip(comm, fsdp, opt, ref, ref_opt, x, y)
        assert norm == pytest.approx(ref_norm, rel=1e-12)
    assert_matches(comm, fsdp, ref)


@pytest.mark.parametrize("finish", ["backward", "sync_gradients"])
@pytest.mark.parametrize("strategy", HYBRID)
def test_no_sync_accumulation_equals_one_big_batch(comm, strategy, finish):
    k = 3
    ref, fsdp = make_model(), FSDP(make_model(), comm, strategy=strategy, shard_size=2)
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    for x, y in batches(3):
        xs, ys = np.split(my_slice(comm, x), k), np.split(my_slice(comm, y), k)
        for i in range(k):
            last = i == k - 1 and finish == "backward"
            with (contextlib.nullcontext() if last else fsdp.no_sync()):
                (crit(fsdp(xs[i]), ys[i]) * (1 / k)).backward()
            if not last:
                assert all(p.grad is None for p in fsdp.parameters()), "no_sync must not reach the shards"
        if finish == "sync_gradients":
            fsdp.sync_gradients()
        assert fsdp.memory_stats()["unsharded_grad_bytes"] == 0
        opt.step()
        opt.zero_grad()
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)


# -- layout and state dicts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shard_size", SHARD_SIZES)
def test_shards_are_chunks_of_the_shard_group_and_replicas_hold_copies(comm, shard_size):
    rank = comm.Get_rank()
    fsdp = FSDP(make_model(seed=rank), comm, strategy="hybrid_shard", shard_size=shard_size)  # takes rank 0's
    reference = make_model(seed=0)
    for s in fsdp.shard_layout():
        assert (s.num_shards, s.shard_index) == (shard_size, rank % shard_size)
        assert (s.num_replicas, s.replica_index) == (4 // shard_size, rank // shard_size)
        np.testing.assert_array_equal(s.parameter.data, expected_shard(reference, [int(s.label)], shard_size,
                                                                       rank % shard_size), err_msg=s.label)
    saved = fsdp.sharded_state_dict()
    assert [e["rank"] for e in saved.values()] == [rank % shard_size] * 5


@pytest.mark.parametrize("shard_size", [2, 1])
def test_load_full_state_dict_reaches_every_replica_and_training_continues(comm, shard_size):
    ref = make_model()
    ref_opt = Adam(list(ref.parameters()), lr=1e-2)
    data = list(batches(6))
    for x, y in data[:3]:
        ref_step(ref, ref_opt, x, y)
    fsdp = FSDP(make_model(seed=5), comm, strategy="hybrid_shard", shard_size=shard_size)
    fsdp.load_full_state_dict(ref.state_dict() if comm.Get_rank() == 0 else None)
    assert_matches(comm, fsdp, ref, tol=0)
    opt, ref_opt = Adam(fsdp.parameters(), lr=1e-2), Adam(list(ref.parameters()), lr=1e-2)
    for x, y in data[3:]:
        fsdp_step(comm, fsdp, opt, x, y)
        ref_step(ref, ref_opt, x, y)
    assert_matches(comm, fsdp, ref)


def test_sharded_state_dict_round_trip(comm):
    fsdp = FSDP(make_model(), comm, strategy="hybrid_shard_grad_op", shard_size=2)
    opt = Adam(fsdp.parameters(), lr=1e-2)
    data = list(batches(4))
    fsdp_step(comm, fsdp, opt, *data[0])
    saved, saved_opt = fsdp.sharded_state_dict(), opt.state_dict()
    assert [e["shard"].shape for e in saved.values()] == [(math.ceil(s / 2),) for s in UNIT_SIZES if s]
    for x, y in data[1:3]:
        fsdp_step(comm, fsdp, opt, x, y)
    expected = fsdp.full_state_dict()
    fsdp_step(comm, fsdp, opt, *data[3])  # move away from the saved state
    fsdp.load_sharded_state_dict(saved)
    opt.load_state_dict(saved_opt)
    for x, y in data[1:3]:
        fsdp_step(comm, fsdp, opt, x, y)
    got = fsdp.full_state_dict()
    assert list(got) == list(expected)
    assert all(np.array_equal(got[k], expected[k]) for k in expected)


# -- memory ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shard_size", SHARD_SIZES)
@pytest.mark.parametrize("strategy", HYBRID)
def test_memory_is_divided_by_the_shard_group_not_the_world(comm, strategy, shard_size):
    fsdp = FSDP(make_model(), comm, strategy=strategy, shard_size=shard_size)
    opt = Adam(fsdp.parameters(), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    for x, y in batches(2):
        crit(fsdp(my_slice(comm, x)), my_slice(comm, y)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # keep the shard grads: they are part of the persistent bytes
    stats = fsdp.memory_stats(opt)
    # ceil(numel / k) elements per unit, whatever the world size: params, grads and two Adam moments each.
    shard_bytes = sum(math.ceil(s / shard_size) * ITEMSIZE for s in UNIT_SIZES if s)
    assert stats["param_shard_bytes"] == stats["grad_shard_bytes"] == shard_bytes
    assert stats["optimizer_state_bytes"] == 2 * shard_bytes
    assert stats["persistent_bytes"] == 4 * shard_bytes
    assert stats["gathered_bytes"] == stats["unsharded_grad_bytes"] == 0
    units = padded_bytes(UNIT_SIZES, shard_size)  # the gathered flat parameters: padded to k, not to 4
    if strategy == "hybrid_shard":
        assert stats["peak_gathered_bytes"] == max(a + b for a, b in zip(units, units[1:]))  # prefetch: 2 units
    else:
        assert stats["peak_gathered_bytes"] == sum(units)  # every unit kept from its forward to its backward


# -- errors ------------------------------------------------------------------------------------------------
def test_hybrid_strategies_parse_and_name_their_zero_stage(comm):
    assert ShardingStrategy.parse("hybrid_shard") is ShardingStrategy.HYBRID_SHARD
    assert ShardingStrategy.HYBRID_SHARD_GRAD_OP.keeps_params_for_backward
    assert ShardingStrategy.SHARD_GRAD_OP.keeps_params_for_backward
    assert not ShardingStrategy.HYBRID_SHARD.keeps_params_for_backward
    assert [s.hybrid for s in ShardingStrategy] == [False, False, False, True, True]
    fsdp = FSDP(make_model(), comm, strategy=ShardingStrategy.HYBRID_SHARD, shard_size=2)
    assert "shards=2 x replicas=2" in repr(fsdp)


@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "hybrid_shard", "shard_size": 3},
     r"shard_size=3 does not divide the 4 ranks of comm; .*pick a divisor of 4 \(\[1, 2, 4\]\)"),
    ({"strategy": "hybrid_shard", "shard_size": 0}, r"shard_size must be an int >= 1 \(got 0\)"),
    ({"strategy": "full_shard", "shard_size": 2}, r"shard_size only apply to the hybrid strategies \(strategy="
                                                  r"'full_shard' uses all 4 ranks\)"),
    ({"strategy": "no_shard", "shard_size": 4}, r"shard_size only apply to the hybrid strategies"),
])
def test_bad_hybrid_settings_name_the_sizes(comm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDP(make_model(), comm, **kwargs)


def test_given_comms_that_do_not_tile_the_world_are_refused_on_every_rank(comm):
    rank = comm.Get_rank()
    pair = comm.Split(color=rank // 2, key=rank)
    with pytest.raises(ValueError, match=r"pass either shard_size \(got 2\) or the pair"):
        FSDP(make_model(), comm, strategy="hybrid_shard", shard_size=2, shard_comm=pair, replicate_comm=pair)
    with pytest.raises(ValueError, match=r"needs shard_size=k .*\(got shard_comm\)"):
        FSDP(make_model(), comm, strategy="hybrid_shard", shard_comm=pair)
    with pytest.raises(ValueError, match=r"shard_comm \(4 ranks\) x replicate_comm \(4 ranks\) = 16 ranks, but comm "
                                         r"has 4"):
        FSDP(make_model(), comm, strategy="hybrid_shard", shard_comm=comm, replicate_comm=comm)
    # Both along one axis: ranks 0 and 2 both sit at (shard 0, replica 0).
    with pytest.raises(ValueError, match=r"ranks share a place \(shard_comm, replicate_comm\) \[\(0, 0\), \(1, 1\)\]"):
        FSDP(make_model(), comm, strategy="hybrid_shard", shard_comm=pair, replicate_comm=pair)
    # Places all distinct, but replica group {0, 1} holds shard indices 0 and 1: shard groups {0, 2} and {3, 1}
    # (rank 3 first) give ranks 0..3 shard indices 0, 1, 1, 0; replica groups {0, 1}, {2, 3}.
    shard_comm = comm.Split(color=rank % 2, key=rank if rank % 2 == 0 else -rank)
    replicate_comm = comm.Split(color=rank // 2, key=rank)
    with pytest.raises(ValueError, match=r"'replicate_comm' joins ranks at different places along \(shard_comm\) "
                                         r"\[\(0,\), \(1,\)\]"):
        FSDP(make_model(), comm, strategy="hybrid_shard", shard_comm=shard_comm, replicate_comm=replicate_comm)


def test_communicators_are_the_shard_and_replica_groups_and_none_when_fully_sharded(comm):
    """What mpidist.elastic revokes after a failure: the groups a hybrid FSDP split off, none for full_shard."""
    fsdp = FSDP(make_model(), comm, strategy="hybrid_shard", shard_size=2)
    shard, replicate = fsdp.communicators()
    assert (shard.Get_size(), replicate.Get_size()) == (2, 2)
    assert shard.Get_rank() == comm.Get_rank() % 2 and fsdp.groups.shard_of == (0, 1, 0, 1)
    # Its mesh: replicate across the groups (outer), shard within them (inner), over comm.
    assert fsdp.mesh.names == ("replicate", "shard") and fsdp.mesh.shape == (2, 2) and fsdp.mesh.comm is comm
    assert fsdp.mesh["shard"] is shard and fsdp.mesh["replicate"] is replicate
    assert FSDP(make_model(), comm).communicators() == ()
    assert FSDP(make_model(), comm, strategy="no_shard").communicators() == ()  # replicas over comm itself
