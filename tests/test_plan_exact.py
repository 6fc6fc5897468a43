"""The planner's communication and memory terms EQUAL what the real wrappers do, layout by layout.

Each test builds a layout for real (``mpidist.plan.execute.LayoutRun``: a tiny GPT, the mesh, tensor parallel,
DDP/FSDP/Pipeline, AdamW), records one training step's collectives and messages with ``mpidist.trace`` (op and
the bytes each rank passed in), and compares them, per rank, with ``calls_per_rank``; then the parameter,
gradient and optimizer bytes the wrappers report with ``memory_per_rank``. Equal, not close.
"""
import contextlib
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from mpidist.parallel import DDP, FSDP
from mpidist.plan import Layout, ModelShape, Profile, Tier, calls_per_rank, estimate, memory_per_rank
from mpidist.plan.estimate import activation_bytes, attention_probs_bytes, gradient_bytes, transient_bytes
from mpidist.plan.execute import LayoutRun, OneRankOfMany, traced_calls
from mpidist.plan.model import parameters
from mpidist.plan.volumes import bucket_params
from test_autograd import saved_bytes

SHAPE = ModelShape(layers=4, hidden=16, heads=4, vocab=37, seq=8)   # 37: vocabulary padded under TP

LAYOUTS_2 = [
    Layout(2, 1, 1),
    Layout(2, 1, 1, micro_batch=2, num_micro=2),
    Layout(1, 2, 1, num_micro=2),
    Layout(1, 2, 1, sequence_parallel=True, recompute="full"),
    Layout(1, 2, 1, sequence_parallel=True, recompute="selective"),   # recomputes no communication
    Layout(2, 1, 1, "fsdp", num_micro=2),
    Layout(1, 1, 2, num_micro=3, schedule="1f1b"),
    Layout(1, 1, 2, num_micro=2, schedule="interleaved", chunks=2),
    Layout(1, 1, 2, num_micro=3, schedule="zb_h1"),
    # mixed precision (nn.precision.Policy, FSDP's param_dtype/reduce_dtype, DDP's communication hooks)
    Layout(2, 1, 1, num_micro=2, param_dtype="bfloat16"),          # the stamp apart from bfloat16 buckets
    Layout(2, 1, 1, param_dtype="float16", compute_dtype="float32"),   # the stamp rides in a float16 bucket
    Layout(2, 1, 1, comm_hook="fp16"),
    Layout(2, 1, 1, param_dtype="bfloat16", comm_hook="bf16"),
    Layout(2, 1, 1, comm_hook="powersgd", powersgd_rank=2),
    Layout(2, 1, 1, "fsdp", param_dtype="bfloat16"),                # 16-bit shards: the ring reduce-scatter
    Layout(2, 1, 1, "fsdp", num_micro=2, gather_dtype="bfloat16"),  # float32 shards gathered in bfloat16
    Layout(1, 2, 1, param_dtype="bfloat16", compute_dtype="float32"),
    Layout(1, 2, 1, param_dtype="bfloat16", compute_dtype="float32", sequence_parallel=True),
    Layout(1, 2, 1, param_dtype="float16", sequence_parallel=True, recompute="full"),
    Layout(1, 2, 1, param_dtype="bfloat16"),   # numpy's bfloat16 matmuls give float32: TP calls carry float32
    Layout(1, 2, 1, param_dtype="bfloat16", sequence_parallel=True),
    Layout(1, 1, 2, num_micro=2, schedule="1f1b", param_dtype="bfloat16"),
    Layout(1, 1, 2, num_micro=2, schedule="1f1b", param_dtype="float16", compute_dtype="float32"),
    Layout(2, 1, 1, "zero1", num_micro=2),                             # ZeroRedundancyOptimizer: its allgather
    Layout(2, 1, 1, "zero1", param_dtype="bfloat16", comm_hook="bf16"),   # its shard's float32 masters
]
LAYOUTS_4 = [
    Layout(4, 1, 1, "hybrid", shard_size=2),
    Layout(2, 2, 1, "fsdp", sequence_parallel=True),
    Layout(2, 1, 2, num_micro=2, schedule="1f1b"),
    Layout(1, 2, 2, num_micro=2, schedule="gpipe", sequence_parallel=True),
    Layout(2, 2, 1, micro_batch=2, recompute="full"),
    Layout(2, 1, 2, num_micro=2, schedule="1f1b", recompute="selective"),
    Layout(1, 1, 4, num_micro=4, schedule="1f1b"),   # middle stages hold no copy of the tied weight
    Layout(4, 1, 1, "hybrid", shard_size=2, param_dtype="bfloat16"),   # replicas average bfloat16 in float32
    Layout(4, 1, 1, "hybrid", shard_size=2, gather_dtype="bfloat16", reduce_dtype="float16"),
    Layout(4, 1, 1, comm_hook="bf16"),
    Layout(4, 1, 1, comm_hook="powersgd"),
    Layout(2, 1, 2, num_micro=2, schedule="1f1b", param_dtype="bfloat16"),
    Layout(2, 2, 1, "fsdp", gather_dtype="bfloat16", compute_dtype="float32"),
    Layout(2, 1, 2, "zero1", num_micro=2, schedule="1f1b"),   # each stage's state split over its two replicas
    Layout(2, 2, 1, "zero1", sequence_parallel=True, param_dtype="bfloat16"),
]


def planned(layout, position, ranks_per_node=0, node_rank=0, shape=SHAPE):
    """The planner's calls as the trace records them: a pipeline receive's size is unknown when it is posted (-1);
    the 16-bit ring's receives are posted into buffers of known size."""
    out = Counter()
    for c in calls_per_rank(shape, layout, position, ranks_per_node, node_rank):
        out[(c.op, -1 if c.op == "recv" and c.group == "pp" else c.nbytes)] += c.count
    return out


def check_layout(comm, layout, ranks_per_node=0, node_rank=0, shape=SHAPE):
    run = LayoutRun(shape, layout, comm)
    run.step()   # the first step allocates (optimizer state, buckets); the traced one is a steady step
    measured = traced_calls(run, comm)
    position = run.grid.pp_rank
    want = planned(layout, position, ranks_per_node, node_rank, shape)
    assert measured == want, (f"{layout.name()} rank {comm.Get_rank()}: measured only {sorted((measured - want).items())}"
                              f", planned only {sorted((want - measured).items())}")
    # the gradients the optimizer is handed after backward (at the step's peak some are not allocated yet)
    memory = dict(memory_per_rank(shape, layout, position), grads=gradient_bytes(shape, layout, position))
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
    return measured, position


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("layout", LAYOUTS_2, ids=lambda lay: lay.name().replace(" ", "-"))
def test_planned_calls_equal_wrappers_2_ranks(comm, layout):
    check_layout(comm, layout)


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("layout", LAYOUTS_4, ids=lambda lay: lay.name().replace(" ", "-"))
def test_planned_calls_equal_wrappers_4_ranks(comm, layout):
    check_layout(comm, layout)


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("num_micro", [2, 4])
def test_planned_calls_equal_wrappers_interleaved_over_three_chunks(comm, num_micro):
    """Interleaved 1F1B with 3 model chunks per rank (``--chunks 3``; 6 blocks over 2 ranks): every traced message
    and the wrappers' byte counts EQUAL the plan's, as for 2 chunks."""
    check_layout(comm, Layout(1, 1, 2, num_micro=num_micro, schedule="interleaved", chunks=3),
                 shape=replace(SHAPE, layers=6))


# Llama's blocks: SwiGLU of 40 units (not a multiple of the width), RMSNorm, rotary positions (no position table:
# no allreduce of its gradient under sequence parallelism), no biases, untied head, grouped-query attention
LLAMA = replace(SHAPE, mlp="swiglu", ffn=40, bias=False, tie_weights=False, kv_heads=2, norm="rmsnorm",
                positions="rope")


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("layout", [Layout(2, 1, 1), Layout(2, 1, 1, "fsdp", num_micro=2),
                                    Layout(1, 2, 1, sequence_parallel=True, param_dtype="bfloat16"),
                                    Layout(1, 1, 2, num_micro=2, schedule="1f1b")],
                         ids=lambda lay: lay.name().replace(" ", "-"))
def test_planned_calls_equal_wrappers_with_llamas_blocks(comm, layout):
    """A SwiGLU MLP's fused gate and up and RMSNorm's missing biases change DDP's buckets, FSDP's units and the
    parameter and optimizer bytes: the traced calls and the wrappers' own byte counts EQUAL the plan's."""
    check_layout(comm, layout, shape=LLAMA)


@pytest.mark.world_sizes(2)
def test_planned_calls_equal_wrappers_rmsnorm_in_a_model_with_biases(comm):
    """RMSNorm has no bias even where the linears have one: under sequence parallelism its weight's gradient is
    summed over the TP ranks and no bias's is (the plan once counted a norm bias's allreduce per norm)."""
    check_layout(comm, Layout(1, 2, 1, sequence_parallel=True), shape=replace(SHAPE, norm="rmsnorm"))


NODE_AWARE = [   # (layout, ranks per simulated node, whether the 16-bit hooks' "auto" goes node-aware)
    (Layout(8, 1, 1, comm_hook="fp16"), 4, True),                           # 2 nodes x 4: leaders' ring over 2
    (Layout(8, 1, 1, param_dtype="bfloat16", comm_hook="bf16"), 2, True),   # 4 nodes x 2: leaders' ring over 4
    (Layout(4, 2, 1, comm_hook="bf16"), 4, True),                           # dp's ranks 2 apart: 2 per node
    (Layout(8, 1, 1, comm_hook="fp16"), 1, False),                          # one rank per node: the flat ring
    (Layout(4, 1, 1, comm_hook="bf16"), 4, False),                          # one node: the flat ring
]


@pytest.mark.parametrize("layout,per_node,node_aware", NODE_AWARE,
                         ids=lambda v: v.name().replace(" ", "-") if isinstance(v, Layout) else str(v))
def test_planned_calls_equal_node_aware_compression_hooks(layout, per_node, node_aware):
    """The fp16/bf16 hooks on simulated nodes (blocks of ``per_node`` ranks): each rank's traced messages (to and
    from its node's leader, the leaders' 16-bit ring) EQUAL the plan for its index on its node, which block
    placement gives from the rank (dp's ranks are ``pp * tp`` apart); where the hooks go node-aware the flat
    ring's plan differs from what they did."""
    import mpidist

    def run(comm):
        node_rank = (comm.Get_rank() % per_node) // (layout.pp * layout.tp)
        measured, position = check_layout(comm, layout, per_node, node_rank)
        return measured != planned(layout, position)

    flat_plan_wrong = mpidist.simulate(layout.ranks, run, ranks_per_node=per_node)
    assert all(flat_plan_wrong) if node_aware else not any(flat_plan_wrong)
    assert any(c.group == "dp_leaders" for c in calls_per_rank(SHAPE, layout, 0, per_node)) == node_aware


def test_node_aware_hook_messages_are_charged_to_the_node_and_inter_node_tiers():
    """The leader's messages in its node cost what they send on the intra tier, the leaders' ring what it sends
    on the inter tier (each measured with the other tier free): bytes / bandwidth, no latency."""
    from mpidist.plan.estimate import _calls_seconds
    layout, per_node = Layout(8, 1, 1, comm_hook="fp16"), 4
    calls = calls_per_rank(SHAPE, layout, 0, per_node)
    numels = [sum(p.numel for p in b) for b in bucket_params(
        [p for layer in ["embed"] + [f"blocks.{i}" for i in range(SHAPE.layers)] + ["head"]
         for p in parameters(SHAPE, layer, 1)], 4)]
    sent = {"intra": sum(3 * 2 * n for n in numels),            # the sum to each of the node's 3 other ranks
            "inter": sum(2 * -(-n // 2) * 2 for n in numels)}   # 2 (nodes - 1) ring steps of half the 16-bit array
    for slow in ("intra", "inter"):
        tiers = {"intra": Tier(0.0, 1e300), "inter": Tier(0.0, 1e300), slow: Tier(0.0, 1.0)}
        seconds = _calls_seconds(calls, replace(UNIT_FLOPS, tiers=tiers), layout, per_node, {"dp_node", "dp_leaders"})
        assert seconds == pytest.approx(sent[slow], rel=1e-12), slow


# -- 512 ranks without 512 threads (OneRankOfMany, mpidist.plan.execute) -------------------------------------
@contextlib.contextmanager
def collectives_counted(calls):
    """Count every call ``mpidist.collectives`` completes while the block runs into Counter ``calls``, as
    (op, input bytes): the flight recorder's record, which ``mpidist.trace`` reads too."""
    from mpidist.guard import record
    from mpidist.plan.execute import _OPS
    before = record.on_leave

    def count(rec):
        calls[(_OPS.get(rec[record.OP], rec[record.OP]), int(rec[record.BYTES]))] += 1
    record.on_leave = count
    try:
        yield
    finally:
        record.on_leave = before


@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
def test_planned_calls_equal_wrappers_at_512_ranks(sharding):
    """At 512 ranks FSDP's shards are ceil(numel / 512) and DDP's stamp modulus changes: still equal."""
    from mpidist import optim
    from mpidist.models.gpt import GPT, GPTConfig
    size = 512
    layout = Layout(size, 1, 1, sharding, num_micro=2)
    config = GPTConfig(vocab_size=SHAPE.vocab, block_size=SHAPE.seq, n_layer=SHAPE.layers, n_head=SHAPE.heads,
                       n_embd=SHAPE.hidden)
    model = GPT(config, rng=np.random.default_rng(0))
    comm = OneRankOfMany(size, rank=3)
    wrapper = FSDP(model, comm, units=model.fsdp_units()) if sharding == "fsdp" else DDP(model, comm)
    opt = optim.AdamW(list(wrapper.parameters()), lr=1e-3)
    x = np.random.default_rng(1).integers(0, SHAPE.vocab, (2, SHAPE.seq))

    def step():
        opt.zero_grad()
        for k in range(2):
            with (wrapper.no_sync() if k == 0 else contextlib.nullcontext()):
                model.loss(wrapper(x[k:k + 1]), x[k:k + 1]).backward()
        opt.step()

    step()
    calls = Counter()
    with collectives_counted(calls):
        step()
    assert calls == planned(layout, 0)


LAYOUTS_512 = [
    Layout(128, 4, 1),                                    # (dp, tp): the mesh's three Splits
    Layout(256, 2, 1, "fsdp", sequence_parallel=True),
    Layout(512, 1, 1, "hybrid", shard_size=8),            # FSDP's (replicate, shard) mesh: two more Splits
    Layout(128, 4, 1, "hybrid", shard_size=16, num_micro=2),
    Layout(512, 1, 1, param_dtype="float16"),             # at 512 ranks the stamp leaves the float16 bucket
    Layout(512, 1, 1, param_dtype="bfloat16", num_micro=2),   # the stamp apart from bfloat16 buckets
    Layout(512, 1, 1, "fsdp", gather_dtype="bfloat16"),
    Layout(128, 4, 1, "zero1", param_dtype="bfloat16"),   # shards of ceil(numel / 128), some ranks' short
    Layout(512, 1, 1, "zero1"),
]


@pytest.mark.parametrize("layout", LAYOUTS_512, ids=lambda lay: lay.name().replace(" ", "-"))
def test_planned_calls_equal_wrappers_at_512_ranks_on_a_mesh(layout):
    """The real mesh, tensor parallelism and hybrid FSDP at 512 ranks, one rank played (a tensor-parallel rank
    other than 0, whose vocabulary shard is the padded one): its calls EQUAL the plan's."""
    splits = [layout.dp, layout.pp, layout.tp]
    if layout.sharding == "hybrid":
        splits += [layout.dp // layout.shard_group, layout.shard_group]
    comm = OneRankOfMany(layout.ranks, rank=layout.tp - 1, splits=splits)
    run = LayoutRun(SHAPE, layout, comm)
    assert comm._shared["splits"] == [] and run.grid.tp_rank == layout.tp - 1
    run.step()
    calls = Counter()
    with collectives_counted(calls):
        run.step()
    assert calls == planned(layout, 0)


# -- selective recompute: the activation bytes it drops and the FLOPs it adds, against the real model -----------
SELECTIVE = [   # (layout, the Split sizes its mesh declares (dp, pp, tp), the model's dtype)
    (Layout(1, 1, 1, micro_batch=2), [1, 1, 1], "float32"),
    (Layout(1, 4, 1, micro_batch=2), [1, 1, 4], "float32"),
    (Layout(2, 4, 1, sequence_parallel=True), [2, 1, 4], "float32"),
    (Layout(8, 1, 1, "fsdp", micro_batch=3), [8, 1, 1], "float32"),
    (Layout(2, 2, 1, param_dtype="bfloat16"), [2, 1, 2], "float32"),   # 16-bit activations: the fp32 op keeps float32
    (Layout(1, 1, 1, micro_batch=2), [1, 1, 1], "float64"),
]
UNIT_FLOPS = Profile("one FLOP/s", {"float32": 1.0, "float64": 1.0, "bfloat16": 1.0}, ((1.0, 1.0), (1e30, 1.0)),
                     memory_bytes=1e30, memory_bandwidth=1.0, tiers={"intra": Tier(0.0, 1.0), "inter": Tier(0.0, 1.0)},
                     elementwise_factor=0.0)


@pytest.mark.parametrize("layout,splits,dtype", SELECTIVE, ids=lambda v: v.name().replace(" ", "-")
                         if isinstance(v, Layout) else v if isinstance(v, str) else "")
def test_selective_recompute_drops_the_planned_bytes_and_adds_the_planned_flops(monkeypatch, layout, splits, dtype):
    """One rank of the real model and wrappers (``OneRankOfMany``: a TP rank other than 0): the bytes the autograd
    graph of one micro-batch keeps fall, from no recompute to selective, by EXACTLY what the planner's activation
    memory drops (``attention_probs_bytes``); one step's extra matmul FLOPs (every product the attention op
    runs, counted from its operands) EQUAL the planner's extra compute under a profile of one FLOP/s."""
    from mpidist.nn import functional as F
    matmul_into, flops = F._matmul_into, [0]

    def counting_matmul_into(a, b, out):
        flops[0] += 2 * out.size * a.shape[-1]
        return matmul_into(a, b, out)

    monkeypatch.setattr(F, "_matmul_into", counting_matmul_into)
    shape = replace(SHAPE, dtype=dtype)
    held, counted = {}, {}
    for recompute in ("none", "selective"):
        lay = Layout(**{**layout.to_dict(), "recompute": recompute})
        comm = OneRankOfMany(lay.ranks, rank=lay.tp - 1, splits=splits)
        run = LayoutRun(shape, lay, comm)
        b = lay.micro_batch
        loss = run.model.loss(run.wrapper(run.x[:b]), run.y[:b])
        held[recompute] = saved_bytes(loss)
        loss.backward()
        flops[0] = 0
        run.step()
        counted[recompute] = flops[0]
    selective = Layout(**{**layout.to_dict(), "recompute": "selective"})
    layers = ["embed"] + [f"blocks.{i}" for i in range(SHAPE.layers)] + ["head"]
    planned = activation_bytes(shape, layout, layers) - activation_bytes(shape, selective, layers)
    assert held["none"] - held["selective"] == planned == attention_probs_bytes(shape, layout, layers) > 0
    extra = (estimate(shape, selective, UNIT_FLOPS, 8).time["compute"]
             - estimate(shape, layout, UNIT_FLOPS, 8).time["compute"])
    assert counted["selective"] - counted["none"] == pytest.approx(extra, rel=1e-12) and extra > 0


@pytest.mark.parametrize("layout", [Layout(1, 1, 1, micro_batch=4), Layout(1, 2, 1, micro_batch=2)],
                         ids=lambda v: v.name().replace(" ", "-"))
def test_transient_is_the_working_memory_above_the_stored_activations_at_the_loss(layout):
    """One rank of the real model (``OneRankOfMany``, the last TP rank), a vocabulary large enough that the head
    dominates: ``tracemalloc``'s peak while one micro-batch goes forward through the model and its loss, above
    what stays allocated once the logits are dropped (the graph's stored activations), is the planner's
    ``transient_bytes`` (one logits-sized array) to within 3%; and ``memory_per_rank`` adds it to the total."""
    import tracemalloc
    shape = ModelShape(layers=1, hidden=16, heads=2, vocab=1024, seq=16)
    comm = OneRankOfMany(layout.ranks, rank=layout.tp - 1, splits=[1, 1, layout.tp])
    run = LayoutRun(shape, layout, comm)
    b = layout.micro_batch
    run.step()   # parameters' gradients and the optimizer's state exist: not counted below
    extras = []
    # tracemalloc counts the whole process: another thread's allocation (the test harness, MPI's progress) can
    # only add to a peak, so the least of three forwards is this one's (a CI run once saw +32 KiB on one rank).
    for _ in range(3):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            logits = run.wrapper(run.x[:b])
            loss = run.model.loss(logits, run.y[:b])
            del logits
            stored, peak = (m - base for m in tracemalloc.get_traced_memory())
        finally:
            tracemalloc.stop()
        assert loss is not None
        del loss
        extras.append(peak - stored)
    layers = ["embed", "blocks.0", "head"]
    planned = transient_bytes(shape, layout, layers)
    assert planned == b * shape.seq * shape.vocab / layout.tp * 4
    assert min(extras) == pytest.approx(planned, rel=0.03)
    assert transient_bytes(shape, layout, ["embed", "blocks.0"]) == 0
    memory = memory_per_rank(shape, layout)
    assert memory["transient"] == planned
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")


# -- activation bytes: one block's saved arrays, against the real autograd graph --------------------------------
PRECISIONS = [   # (the model's dtype, Layout's precision fields)
    ("float32", {}),
    ("float64", {}),
    ("float32", {"param_dtype": "bfloat16"}),                            # 16-bit activations: fp32 ops keep float32
    ("float32", {"param_dtype": "float16"}),
    ("float32", {"param_dtype": "bfloat16", "compute_dtype": "float32"}),   # float32 activations, 16-bit norms
]


def block_graph_bytes(shape, layout):
    """The bytes one micro-batch's autograd graph keeps for one block on one rank of many (the last TP rank): the
    graph of a 2-block model less that of a 1-block one (the same embedding and head)."""
    kept = []
    for blocks in (2, 1):
        comm = OneRankOfMany(layout.ranks, rank=layout.tp - 1, splits=[layout.dp, layout.pp, layout.tp])
        run = LayoutRun(replace(shape, layers=blocks), layout, comm)
        b = layout.micro_batch
        kept.append(saved_bytes(run.model.loss(run.wrapper(run.x[:b]), run.y[:b])))
    return kept[0] - kept[1]


@pytest.mark.mpi_skip  # one process, no MPI (a counting communicator): under mpiexec every rank would repeat it
@pytest.mark.parametrize("tp,sequence_parallel,kv_heads,dropout,mlp,norm,positions", [
    (1, False, None, 0.0, "gelu", "layernorm", "learned"), (2, False, None, 0.0, "gelu", "layernorm", "learned"),
    (2, True, None, 0.0, "gelu", "layernorm", "learned"), (4, False, None, 0.0, "gelu", "layernorm", "learned"),
    (4, True, None, 0.0, "gelu", "layernorm", "learned"), (1, False, 2, 0.0, "gelu", "layernorm", "learned"),
    (2, True, 2, 0.0, "gelu", "layernorm", "learned"), (1, False, None, 0.1, "gelu", "layernorm", "learned"),
    (2, True, None, 0.1, "gelu", "layernorm", "learned"),
    (1, False, None, 0.0, "swiglu", "layernorm", "learned"), (2, True, None, 0.0, "swiglu", "layernorm", "learned"),
    (1, False, None, 0.0, "gelu", "rmsnorm", "rope"), (2, False, 2, 0.1, "swiglu", "rmsnorm", "rope"),
    (2, True, 2, 0.0, "swiglu", "rmsnorm", "rope"), (4, True, None, 0.1, "swiglu", "rmsnorm", "rope")],
    ids=lambda v: str(v))
def test_activation_bytes_equal_one_blocks_saved_arrays(tp, sequence_parallel, kv_heads, dropout, mlp, norm,
                                                        positions):
    """For every precision, recompute mode and micro-batch size: the bytes one block's real ops keep for backward
    (norms' xhat and statistics, linears' inputs, attention's qkv, output and probabilities, GELU's input and
    half-tanh; float32 copies of 16-bit norm weights) EQUAL ``activation_bytes(shape, layout, ["blocks.0"])``;
    with grouped-query attention too (2 k/v heads for 4 heads), with dropout (its masks, 1 byte each), with a
    SwiGLU MLP (its fused gate and up, 2 x 24 units: not a multiple of the width), with RMSNorm (one statistic
    per row) and with rotary positions (``F.rotary`` keeps nothing: attention keeps the turned qkv)."""
    shape = ModelShape(layers=1, hidden=16, heads=4, vocab=37, seq=8, kv_heads=kv_heads, dropout=dropout, mlp=mlp,
                       ffn=24 if mlp == "swiglu" else None, norm=norm, positions=positions)
    for dtype, precision in PRECISIONS:
        for recompute in ("none", "selective", "full"):
            for micro_batch in (1, 2):
                layout = Layout(1, tp, 1, micro_batch=micro_batch, recompute=recompute,
                                sequence_parallel=sequence_parallel, **precision)
                s = replace(shape, dtype=dtype)
                assert block_graph_bytes(s, layout) == activation_bytes(s, layout, ["blocks.0"]), (layout.name(), dtype)


@pytest.mark.mpi_skip  # one process, no MPI (a counting communicator): under mpiexec every rank would repeat it
@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True), (4, True)], ids=lambda v: str(v))
def test_one_16_bit_blocks_saved_bytes_are_korthikantis_formula_terms(tp, sequence_parallel):
    """Under 16-bit activations one block keeps what Korthikanti et al. (arXiv 2205.05198, Section 4.1) count
    for Megatron-LM, less dropout's masks: 2 bytes per element of the two norms' inputs and the two linear inputs
    they feed (8sbh, split under sequence parallelism), of q, k, v, the projection's input, GELU's input and fc2's
    input (24sbh / t), the probabilities (2as^2b / t, which selective recompute drops), plus the norms' two float32
    statistics per token (16sb, split under sequence parallelism) and under sequence parallelism the two norms'
    16-bit weights (2h x 2 bytes, not per token); full recompute keeps the block's input (2sbh, split under
    sequence parallelism). The paper's formula, not the planner's."""
    seq, h, a = 8, 16, 4
    shape = ModelShape(layers=1, hidden=h, heads=a, vocab=37, seq=seq)
    split = tp if sequence_parallel else 1
    for param_dtype in ("bfloat16", "float16"):
        for recompute in ("none", "selective", "full"):
            for b in (1, 2):
                layout = Layout(1, tp, 1, micro_batch=b, recompute=recompute, sequence_parallel=sequence_parallel,
                                param_dtype=param_dtype)
                sbh = seq * b * h
                if recompute == "full":
                    formula = 2 * sbh / split
                else:
                    formula = 8 * sbh / split + 24 * sbh / tp + 16 * seq * b / split
                    if sequence_parallel:   # the norms' weights, read as copies (2 d per block, not per token)
                        formula += 2 * h * 2
                    if recompute == "none":
                        formula += 2 * a * seq * seq * b / tp
                assert block_graph_bytes(shape, layout) == formula, (layout.name(), param_dtype)


@pytest.mark.parametrize("gather_dtype", ["bfloat16", "float16"])
def test_fsdp_gathered_in_16_bit_keeps_activations_in_its_ops_dtype(gather_dtype):
    """FSDP(param_dtype=16-bit) on a float32 model without a Policy: float16 units compute in float16, bfloat16
    units in float32 (numpy's bfloat16 matmul returns float32); the planner once counted both as 16-bit."""
    shape = ModelShape(layers=1, hidden=16, heads=4, vocab=37, seq=8)
    for micro_batch in (1, 2):
        layout = Layout(2, 1, 1, sharding="fsdp", micro_batch=micro_batch, gather_dtype=gather_dtype)
        assert block_graph_bytes(shape, layout) == activation_bytes(shape, layout, ["blocks.0"]), layout.name()
