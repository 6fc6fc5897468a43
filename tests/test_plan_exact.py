"""The planner's communication and memory terms EQUAL what the real wrappers do, layout by layout.

Each test builds a layout for real (``mpidist.plan.execute.LayoutRun``: a tiny GPT, the mesh, tensor parallel,
DDP/FSDP/Pipeline, AdamW), records one training step's collectives and messages with ``mpidist.trace`` (op and
the bytes each rank passed in), and compares them, per rank, with ``calls_per_rank``; then the parameter,
gradient and optimizer bytes the wrappers report with ``memory_per_rank``. Equal, not close.
"""
from collections import Counter

import pytest

from mpidist.parallel import DDP, FSDP
from mpidist.plan import Layout, ModelShape, calls_per_rank, memory_per_rank
from mpidist.plan.execute import LayoutRun, traced_calls

SHAPE = ModelShape(layers=3, hidden=16, heads=4, vocab=37, seq=8)   # 37: vocabulary padded under TP

LAYOUTS_2 = [
    Layout(2, 1, 1),
    Layout(2, 1, 1, micro_batch=2, num_micro=2),
    Layout(1, 2, 1, num_micro=2),
    Layout(1, 2, 1, sequence_parallel=True, recompute="full"),
    Layout(2, 1, 1, "fsdp", num_micro=2),
    Layout(1, 1, 2, num_micro=3, schedule="1f1b"),
    Layout(1, 1, 2, num_micro=2, schedule="interleaved", chunks=2),
    Layout(1, 1, 2, num_micro=3, schedule="zb_h1"),
]
LAYOUTS_4 = [
    Layout(4, 1, 1, "hybrid", shard_size=2),
    Layout(2, 2, 1, "fsdp", sequence_parallel=True),
    Layout(2, 1, 2, num_micro=2, schedule="1f1b"),
    Layout(1, 2, 2, num_micro=2, schedule="gpipe", sequence_parallel=True),
    Layout(2, 2, 1, micro_batch=2, recompute="full"),
]


def planned(layout, position):
    """The planner's calls as the trace records them: a receive's size is unknown when it is posted (-1)."""
    out = Counter()
    for c in calls_per_rank(SHAPE, layout, position):
        out[(c.op, -1 if c.op == "recv" else c.nbytes)] += c.count
    return out


def check_layout(comm, layout):
    run = LayoutRun(SHAPE, layout, comm)
    run.step()   # the first step allocates (optimizer state, buckets); the traced one is a steady step
    measured = traced_calls(run, comm)
    position = run.grid.pp_rank
    want = planned(layout, position)
    assert measured == want, (f"{layout.name()} rank {comm.Get_rank()}: measured only {sorted((measured - want).items())}"
                              f", planned only {sorted((want - measured).items())}")
    memory = memory_per_rank(SHAPE, layout, position)
    stats = run.interface.memory_stats(run.opt)
    if isinstance(run.wrapper, FSDP):
        got = {"params": stats["param_shard_bytes"], "grads": stats["grad_shard_bytes"],
               "optimizer": stats["optimizer_state_bytes"]}
    else:
        got = {"params": stats["param_bytes"], "optimizer": stats["optimizer_state_bytes"]}
        if isinstance(run.wrapper, DDP):   # its buckets hold the gradients and the step stamp
            got["grads"] = sum(int(b.flat.nbytes) for b in run.wrapper.buckets)
        elif layout.pp == 1:
            got["grads"] = stats["grad_bytes"]
    assert {k: memory[k] for k in got} == got, layout.name()


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("layout", LAYOUTS_2, ids=lambda lay: lay.name().replace(" ", "-"))
def test_planned_calls_equal_wrappers_2_ranks(comm, layout):
    check_layout(comm, layout)


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("layout", LAYOUTS_4, ids=lambda lay: lay.name().replace(" ", "-"))
def test_planned_calls_equal_wrappers_4_ranks(comm, layout):
    check_layout(comm, layout)
