"""FSDP-wrapped pipeline stages under the zero-bubble schedule (B and W split) against one process.

Ranks form a (dp, pp) grid: pipeline position ``rank % 2`` of replica ``rank // 2``. Each rank wraps its stage
in FSDP over its dp ranks (the same position in every replica) and runs ``Pipeline(fsdp_stage, pp_comm,
schedule="zb_h1")``; each replica trains on its own slice of the global batch. B computes only input
gradients (``nn.backward_input``), so FSDP's gradient reduction must wait for W (``DeferredWeightGrads.run``),
and W must see gathered parameters again. The reference trains the unsplit model in one process on the
whole batch in float64; parameters must agree to rounding after every step.
"""

import time

import numpy as np
import pytest

import mpidist.nn as nn
from mpidist.guard import record
from mpidist.optim import Adam
from mpidist.parallel.fsdp import FSDP
from mpidist.parallel.pipeline import Pipeline

BATCH = 24  # divisible by the replicas (1 or 2), then by the micro-batches (3)
MICROBATCHES = 3
STEPS = 3
TOL = 1e-10


class Scaled(nn.Module):
    """``x * scale**2``: the square's own backward reads the parameter, and it leads to no input, so it runs
    in the deferred weight pass: W must see the unit gathered."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(np.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x * (self.scale * self.scale)


def make_stage(s):
    """Stage 0: Linear, Tanh, Scaled, Linear; stage 1: Tanh, Linear, Scaled, LayerNorm, Linear to 5 classes."""
    rng = np.random.default_rng(10 + s)
    f64 = np.float64
    if s == 0:
        return nn.Sequential(nn.Linear(4, 9, rng=rng, dtype=f64), nn.Tanh(), Scaled(9),
                             nn.Linear(9, 7, rng=rng, dtype=f64))
    return nn.Sequential(nn.Tanh(), nn.Linear(7, 11, rng=rng, dtype=f64), Scaled(11), nn.LayerNorm(11, dtype=f64),
                         nn.Linear(11, 5, rng=rng, dtype=f64))


def reduce_scatters(comm, since):
    """How many reduce-scatters on ``comm`` started after ``since`` the flight recorder holds (the ring is shared by
    simulated ranks, and full after a long session: counting what is new, not a difference of totals)."""
    return sum(1 for r in record.snapshot() if r[record.OP] == "ireduce_scatter" and r[record.COMM].owner() is comm
               and r[record.START] >= since)


def batches():
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        yield rng.standard_normal((BATCH, 4)), rng.integers(0, 5, BATCH)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("schedule", ["zb_h1", "1f1b"])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"])
def test_fsdp_stages_under_zero_bubble_train_like_one_process(comm, strategy, schedule):
    size, rank = comm.Get_size(), comm.Get_rank()
    stage, replica, replicas = rank % 2, rank // 2, size // 2
    pp_comm = comm.Split(color=replica, key=rank)
    dp_comm = comm.Split(color=stage, key=rank)
    # hybrid_shard: shards of one rank, replicated over the dp ranks (the chunk's allreduce runs in W too).
    fsdp = FSDP(make_stage(stage), dp_comm, strategy=strategy, **({"shard_size": 1} if strategy == "hybrid_shard" else {}))
    pipe = Pipeline(fsdp, pp_comm, MICROBATCHES, schedule=schedule, loss_fn=nn.CrossEntropyLoss())
    opt = Adam(list(fsdp.parameters()), lr=1e-2)
    ref = nn.Sequential(make_stage(0), make_stage(1))
    ref_opt = Adam(list(ref.parameters()), lr=1e-2)
    crit = nn.CrossEntropyLoss()
    per = BATCH // replicas
    units = sum(1 for u in fsdp.units if u.params)
    for x, y in batches():
        mine = slice(replica * per, (replica + 1) * per)
        since = time.monotonic()
        pipe.step(x[mine], y[mine])
        if strategy != "no_shard":
            # One per unit per micro-batch, in W: a B pass reduces nothing (there is no parameter gradient yet).
            assert reduce_scatters(fsdp.shard_comm, since) == MICROBATCHES * units
        if schedule == "zb_h1":
            assert pipe.stats.peak_pending_w > 0  # W really ran after B
        assert fsdp.reductions_in_flight() == () and fsdp.num_inflight() == 0
        opt.step()
        opt.zero_grad()
        crit(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with fsdp.summon_full_params() as module:
        for (name, p), q in zip(module.named_parameters(), ref[stage].parameters()):
            np.testing.assert_allclose(p.data, q.data, rtol=0, atol=TOL, err_msg=f"stage {stage} {name}")
    if strategy != "no_shard":
        assert all(p.data.size == 0 for p in fsdp.module.parameters()), "full parameters must be freed at rest"
