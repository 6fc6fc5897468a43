"""Tensor and sequence parallelism (mpidist.parallel.tensor) and the 3-D mesh, against independent references.

- The communication ops forward and backward against numpy on every rank's inputs (each rank draws all ranks'
  inputs and upstream gradients from seeds), and the vocab-parallel cross-entropy against ``F.cross_entropy``
  on the full logits, with padded vocabularies (including a rank holding only padding) and ``ignore_index``.
- Each parallel layer, built from an unsharded layer, against that layer: this rank's part of the output, of
  the input gradient and of every parameter gradient (mapped through its placement; padding stays zero).
- Training parity: a tiny GPT (2 layers, width 32, 4 heads, context 16, float64, no dropout) converted by
  ``tensor_parallel`` and trained 3 AdamW steps with clipping active in every step, on every (dp, tp, pp)
  whose product is 2 or 4 (and some of 8 on SimComm), with and without sequence parallelism, DDP over the
  mesh's dp ranks and a Pipeline over its pp ranks; FSDP over the dp ranks (with and without clipping). Every rank
  compares its slices, the losses and the gradient norms with single-process training on the global batches.
- ``clip_grad_norm_`` counts a replicated parameter once; greedy ``generate`` on a split model; the errors.

Runs on SimComm worlds and under ``mpiexec -n 2 / -n 4 pytest --with-mpi``.
"""
import functools
import math
import threading

import numpy as np
import pytest

from mpidist import collectives, nn, simulate
from mpidist.models import GPT, GPTConfig, lm_loss
from mpidist.nn import functional as F
from mpidist.nn.autograd import backward_input, make_result
from mpidist.nn.placement import Replicate, Shard, placement_of
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.optim import AdamW
from mpidist.models import tensor_parallel
from mpidist.parallel import DDP, FSDP, Pipeline, mesh
from mpidist.parallel.tensor import (ColumnParallelLinear, ParallelAttention, ParallelLayerNorm, ParallelMLP,
                                     RowParallelLinear, TensorParallelModule, VocabParallelEmbedding, copy_to_tp,
                                     gather_last, gather_sequence, gather_sequence_linear, padded_split,
                                     reduce_from_tp, scatter_sequence, vocab_parallel_cross_entropy)
from test_autograd import saved_bytes

TOL = 1e-10
STEPS = 3
LR = 1e-2
MAX_NORM = 0.3   # below every step's gradient norm (reference() checks): clipping always acts
VOCAB, T, D, HEADS = 256, 16, 32, 4
BATCH = 8


def config(n_layer=2, **kw):
    return GPTConfig(**dict(dict(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=HEADS, n_embd=D,
                                 dropout=0.0, dtype="float64"), **kw))


def make_model(n_layer=2, **kw):
    """The same initial weights on every rank and in the reference: one seeded generator builds the model."""
    return GPT(config(n_layer, **kw), rng=np.random.default_rng(0))


def global_batch(step, n=BATCH, vocab=VOCAB):
    """Step ``step``'s global batch of ``n`` sequences (token ids, next-token targets), equal on every rank."""
    tokens = np.random.default_rng(1000 + step).integers(0, vocab, (n, T + 1))
    return tokens[:, :-1], tokens[:, 1:]


def rows(a, part, parts):
    n = len(a) // parts
    assert n * parts == len(a), f"batch of {len(a)} does not split into {parts} equal parts"
    return a[part * n:(part + 1) * n]


_reference_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _reference(n_layer, clip, model_kw):
    model = make_model(n_layer, **dict(model_kw))
    opt = AdamW(list(model.parameters()), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, vocab=model.config.vocab_size)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        params = list(model.parameters())
        norms.append(float(nn.clip_grad_norm_(params, MAX_NORM) if clip else nn.grad_norm(params)))
        losses.append(float(loss))
        opt.step()
    state = model.state_dict()
    for a in state.values():
        a.setflags(write=False)
    return state, losses, norms


def reference(n_layer=2, clip=True, **model_kw):
    """(state_dict, losses, gradient norms) of single-process training on the global batches."""
    with _reference_lock:  # simulated ranks are threads: compute once, share the read-only result
        state, losses, norms = _reference(n_layer, clip, tuple(sorted(model_kw.items())))
    if clip:
        assert min(norms) > MAX_NORM, f"clipping must be active in every step (norms {norms})"
    return state, losses, norms


# -- comparing a rank's slice with the global tensor -----------------------------------------------------------
def assert_slice_matches(local, placement, full, what):
    """``local`` (this rank's array) holds ``full``'s values where ``placement`` says; padding is zero."""
    local, full = np.asarray(local), np.asarray(full)
    if not isinstance(placement, Shard):
        assert placement is None or isinstance(placement, Replicate), what
        np.testing.assert_allclose(local, full, rtol=TOL, atol=TOL, err_msg=what)
        return
    assert placement.global_shape == full.shape, what
    covered = np.zeros(local.shape, dtype=bool)
    for offsets, sizes, local_offsets in placement.chunks(local.shape):
        theirs = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        mine = tuple(slice(o, o + s) for o, s in zip(local_offsets, sizes))
        assert not covered[mine].any(), f"{what}: chunks overlap"
        covered[mine] = True
        np.testing.assert_allclose(local[mine], full[theirs], rtol=TOL, atol=TOL, err_msg=what)
    np.testing.assert_array_equal(local[~covered], 0, err_msg=f"{what}: padding must stay zero")


def split(a, kind, comm, local=None):
    """This rank's part of a full activation: ``full``; ``seq`` (its block of the sequence axis 1); ``feat``
    (its ``local`` features of the last axis, zero-padded past the end)."""
    r, n = comm.Get_rank(), comm.Get_size()
    if kind == "full":
        return a
    if kind == "seq":
        k = a.shape[1] // n
        return a[:, r * k:(r + 1) * k]
    out = np.zeros(a.shape[:-1] + (local,), dtype=a.dtype)
    part = a[..., r * local:(r + 1) * local]
    out[..., :part.shape[-1]] = part
    return out


# -- the communication ops ----------------------------------------------------------------------------------------
def per_rank(seed, size, shape):
    """Every rank's array (rank r's from seed + r): each rank can compute what the others hold."""
    return [np.random.default_rng(seed + r).standard_normal(shape) for r in range(size)]


def forward_and_grad(op, x, g, comm, **kw):
    leaf = nn.Tensor(x.copy(), requires_grad=True)
    out = op(leaf, comm, **kw)
    return out.data, nn.grad(out, leaf, grad_outputs=g)


@pytest.mark.world_sizes(2, 4)
def test_ops_forward_and_backward_match_numpy(comm):
    n, r = comm.Get_size(), comm.Get_rank()
    b, t, f = 2, 3, 5
    xs, gs = per_rank(10, n, (b, t, f)), per_rank(20, n, (b, t, f))

    out, grad = forward_and_grad(copy_to_tp, xs[r], gs[r], comm)
    np.testing.assert_array_equal(out, xs[r])
    np.testing.assert_allclose(grad, sum(gs), rtol=TOL, atol=TOL)

    out, grad = forward_and_grad(reduce_from_tp, xs[r], gs[r], comm)
    np.testing.assert_allclose(out, sum(xs), rtol=TOL, atol=TOL)
    np.testing.assert_array_equal(grad, gs[r])

    # Sequence axis 1: gather_sequence takes (b, t, f) shards to (b, n*t, f); its upstream gradient is full length.
    long_gs = per_rank(30, n, (b, n * t, f))
    out, grad = forward_and_grad(gather_sequence, xs[r], long_gs[r], comm)
    np.testing.assert_array_equal(out, np.concatenate(xs, axis=1))
    np.testing.assert_allclose(grad, sum(long_gs)[:, r * t:(r + 1) * t], rtol=TOL, atol=TOL)

    long_xs = per_rank(40, n, (b, n * t, f))
    out, grad = forward_and_grad(scatter_sequence, long_xs[r], gs[r], comm)
    np.testing.assert_allclose(out, sum(long_xs)[:, r * t:(r + 1) * t], rtol=TOL, atol=TOL)
    np.testing.assert_array_equal(grad, np.concatenate(gs, axis=1))

    # Another axis: the batch.
    out, grad = forward_and_grad(gather_sequence, xs[r], per_rank(50, n, (n * b, t, f))[r], comm, axis=0)
    np.testing.assert_array_equal(out, np.concatenate(xs, axis=0))
    np.testing.assert_allclose(grad, sum(per_rank(50, n, (n * b, t, f)))[r * b:(r + 1) * b], rtol=TOL, atol=TOL)

    wide_gs = per_rank(60, n, (b, t, n * f))
    out, grad = forward_and_grad(gather_last, xs[r], wide_gs[r], comm)
    np.testing.assert_array_equal(out, np.concatenate(xs, axis=-1))
    np.testing.assert_array_equal(grad, wide_gs[r][..., r * f:(r + 1) * f])


@pytest.mark.world_sizes(2, 4)
def test_scatter_of_an_uneven_sequence_raises_with_the_sizes(comm):
    n = comm.Get_size()
    x = nn.Tensor(np.ones((2, 2 * n + 1, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=rf"axis 1 of length {2 * n + 1} does not split evenly over {n} "):
        scatter_sequence(x, comm)


@pytest.mark.world_sizes(2, 4)
# 250 pads the last slice at tp 4; 5 at tp 4 leaves rank 3 nothing but padding
@pytest.mark.parametrize("vocab", [256, 250, 5])
def test_vocab_parallel_cross_entropy_equals_cross_entropy_of_the_full_logits(comm, vocab):
    n, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((3, 5, vocab)) * 3
    target = rng.integers(0, vocab, (3, 5))
    target[0, 1] = target[2, 4] = -1  # ignored tokens
    target[1, 0] = vocab - 1          # the last real column, next to the padding
    full = nn.Tensor(logits, requires_grad=True)
    expected = F.cross_entropy(full, target, ignore_index=-1)
    expected.backward()

    local = padded_split(vocab, n, "test")
    mine = split(logits, "feat", comm, local)
    mine[..., max(0, vocab - r * local):] = 1e3  # padding must be masked out, whatever it holds
    leaf = nn.Tensor(mine, requires_grad=True)
    loss = vocab_parallel_cross_entropy(leaf, target, comm, r * local, vocab, ignore_index=-1)
    loss.backward()
    assert float(loss) == pytest.approx(float(expected), rel=TOL)
    np.testing.assert_allclose(leaf.grad, split(full.grad, "feat", comm, local), rtol=TOL, atol=TOL)


# -- the layers, each against the layer it was built from ---------------------------------------------------------
B, S, W = 2, 8, 8  # layer tests: batch, sequence (divisible by 2 and 4), width


def _random_biases(layer, seed):
    rng = np.random.default_rng(seed)
    for _, p in layer.named_parameters():
        if p.data.ndim == 1:
            p.data[...] = rng.standard_normal(p.data.shape) * 0.1
    return layer


LAYERS = {  # name: (unsharded layer from a seed, parallel class, input kind, output kind without SP)
    "column": (lambda rng: nn.Linear(W, 10, rng=rng, dtype=np.float64), ColumnParallelLinear, "full", "feat"),
    "row": (lambda rng: nn.Linear(10, W, rng=rng, dtype=np.float64), RowParallelLinear, "feat", "full"),
    "attention": (lambda rng: nn.MultiheadAttention(W, 4, causal=True, rng=rng, dtype=np.float64),
                  ParallelAttention, "full", "full"),
    "mlp": (lambda rng: nn.MLP(W, 10, rng=rng, dtype=np.float64), ParallelMLP, "full", "full"),
    "layernorm": (lambda rng: nn.LayerNorm(W, dtype=np.float64), ParallelLayerNorm, "full", "full"),
    "embedding": (lambda rng: nn.Embedding(11, W, rng=rng, dtype=np.float64), VocabParallelEmbedding, "ids", "full"),
}


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_parallel_layer_equals_the_layer_it_was_built_from(comm, name, sequence_parallel):
    build, parallel, in_kind, out_kind = LAYERS[name]
    n = comm.Get_size()
    reference_layer = _random_biases(build(np.random.default_rng(3)), 4)
    if name == "layernorm":  # gain and shift away from 1 and 0, so that their gradients matter
        rng = np.random.default_rng(5)
        for p in reference_layer.parameters():
            p.data[...] = rng.standard_normal(p.data.shape)
    source = build(np.random.default_rng(3))  # a twin: the parallel layer may keep its replicated parameters
    source.load_state_dict(reference_layer.state_dict())
    layer = parallel(source, comm, sequence_parallel)

    # Under sequence parallelism the residual stream (full-width activations) is split along the sequence.
    in_kind = "seq" if sequence_parallel and in_kind == "full" else in_kind
    out_kind = "seq" if sequence_parallel and out_kind == "full" else out_kind
    in_local = padded_split(10, n, "test") if in_kind == "feat" else None
    out_local = layer.local if out_kind == "feat" else None
    rng = np.random.default_rng(6)
    if in_kind == "ids":
        x = rng.integers(0, 11, (B, S))
        x[0, :4] = 10  # the last row, next to the padding
        expected = reference_layer(x)
        out = layer(x)  # every rank looks up the whole batch (its output may be a sequence shard)
    else:
        x = rng.standard_normal((B, S, 10 if in_kind == "feat" else W))
        full_in = nn.Tensor(x, requires_grad=True)
        expected = reference_layer(full_in)
        local_in = nn.Tensor(split(x, in_kind, comm, in_local), requires_grad=True)
        out = layer(local_in)
    upstream = rng.standard_normal(expected.shape)
    expected.backward(upstream)
    np.testing.assert_allclose(out.data, split(expected.data, out_kind, comm, out_local), rtol=TOL, atol=TOL)
    out.backward(split(upstream, out_kind, comm, out_local))

    if in_kind != "ids":
        np.testing.assert_allclose(local_in.grad, split(full_in.grad, in_kind, comm, in_local), rtol=TOL, atol=TOL)
    expected_params = dict(reference_layer.named_parameters())
    params = dict(layer.named_parameters())
    assert sorted(params) == sorted(expected_params)
    for pname, p in params.items():
        assert_slice_matches(p.data, placement_of(p), expected_params[pname].data, f"{name} {pname} value")
        assert_slice_matches(p.grad, placement_of(p), expected_params[pname].grad, f"{name} {pname} gradient")


# -- training on a mesh against one process -----------------------------------------------------------------------
def stage_parameters(model, stage):
    """(reference name, parameter) of each parameter of ``stage``; a pipeline's copy of the tied weight is named
    after the weight it copies."""
    names = {id(p): name for name, p in model.named_parameters()}
    named = [(names.get(id(p), "embed.wte.weight"), p) for p in stage.parameters()]
    assert all(id(p) in names or any(p is t for t in stage.tied) for _, p in named)
    return named


def train_on_mesh(comm, dp, tp, pp, sequence_parallel, **model_kw):
    """Train the split GPT on a dp x pp x tp mesh (DDP over dp, Pipeline over pp); compare with one process."""
    state, ref_losses, ref_norms = reference(**model_kw)
    grid = mesh(comm, dp=dp, pp=pp, tp=tp)
    assert (grid.dp, grid.pp, grid.tp) == (dp, pp, tp)
    model = tensor_parallel(make_model(**model_kw), grid.tp_comm, sequence_parallel=sequence_parallel)
    if pp > 1:
        stage = model.pipeline_stages(pp)[grid.pp_rank]
        wrapper = Pipeline(stage, grid.pp_comm, 2, "1f1b", loss_fn=model.loss,
                           dp_comm=grid.dp_comm if dp > 1 else None, tied_parameters=stage.tied)
        named = stage_parameters(model, stage)
    else:
        wrapper = DDP(model, grid.dp_comm) if dp > 1 else None
        named = list(model.named_parameters())
    opt = AdamW([p for _, p in named], lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (rows(a, grid.dp_rank, dp) for a in global_batch(step, vocab=model.config.vocab_size))
        opt.zero_grad()
        if pp > 1:
            losses.append(wrapper.step(x, y, broadcast_loss=True))
            norms.append(wrapper.clip_grad_norm_(MAX_NORM))
        else:
            loss = model.loss((wrapper or model)(x), y)
            loss.backward()
            losses.append(float(np.mean(grid.dp_comm.allgather(float(loss)))))  # equal slices: mean of means
            norms.append(float(wrapper.clip_grad_norm_(MAX_NORM) if wrapper else
                               nn.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=0, err_msg="losses")
    np.testing.assert_allclose(norms, ref_norms, rtol=TOL, atol=0, err_msg="gradient norms before clipping")
    for name, p in named:
        assert_slice_matches(p.data, placement_of(p), state[name], name)
    if pp > 1:
        for group in wrapper.tied:
            group.free()
    grid.free()


LAYOUTS_2 = [(2, 1, 1, True), (1, 2, 1, True), (1, 1, 2, True), (1, 2, 1, False)]  # (dp, tp, pp, sequence parallel)
LAYOUTS_4 = [(4, 1, 1, True), (1, 4, 1, True), (1, 1, 4, True), (2, 2, 1, True), (2, 1, 2, True), (1, 2, 2, True),
             (1, 4, 1, False), (2, 2, 1, False), (1, 2, 2, False)]
LAYOUTS_8 = [(2, 2, 2, True), (1, 4, 2, True), (2, 4, 1, False)]


def _layout_id(layout):
    dp, tp, pp, sp = layout
    return f"dp{dp}-tp{tp}-pp{pp}-{'sp' if sp else 'nosp'}"


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("layout", LAYOUTS_2, ids=_layout_id)
def test_mesh_of_2_trains_like_one_process(comm, layout):
    train_on_mesh(comm, *layout)


@pytest.mark.world_sizes(2, 4)
def test_grouped_query_attention_trains_like_one_process(comm):
    """2 k/v heads for 4 heads: each TP rank holds its q heads' k/v group (sequence parallel at 2 ranks; with a
    pipeline and with data parallelism at 4); 4 k/v heads for 8, several per rank at tp 2, one at tp 4."""
    layouts = [(1, 2, 1, True)] if comm.Get_size() == 2 else [(2, 2, 1, False), (1, 2, 2, True)]
    for dp, tp, pp, sequence_parallel in layouts:
        train_on_mesh(comm, dp, tp, pp, sequence_parallel, n_kv_head=2)
    train_on_mesh(comm, 1, comm.Get_size(), 1, True, n_head=8, n_kv_head=4)


@pytest.mark.world_sizes(2, 4)
def test_llama_blocks_train_like_one_process(comm):
    """Llama's blocks (SwiGLU of 40 units, fused gate and up; RMSNorm; rotary positions; no biases): each TP rank
    holds the same units of the gate and of up and the whole norms, and turns its own heads' q and k (sequence
    parallel at 2 ranks; with data parallelism and with a pipeline at 4, and tp 4)."""
    kw = dict(mlp="swiglu", ffn_hidden=40, bias=False, norm="rmsnorm", positions="rope")
    layouts = ([(1, 2, 1, True)] if comm.Get_size() == 2 else
               [(2, 2, 1, False), (1, 2, 2, True), (1, 4, 1, True)])
    for dp, tp, pp, sequence_parallel in layouts:   # 2 k/v heads for 4 where tp splits them (rotary with GQA)
        train_on_mesh(comm, dp, tp, pp, sequence_parallel, **kw, **({"n_kv_head": 2} if tp == 2 else {}))


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("layout", LAYOUTS_4, ids=_layout_id)
def test_mesh_of_4_trains_like_one_process(comm, layout):
    train_on_mesh(comm, *layout)


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_padded_vocabulary_trains_like_one_process(comm, tie):
    # 250 tokens over 4 ranks: 63 rows each, the last rank's two padding rows stay zero; an untied head's
    # weight is split on its own, with the same padding.
    train_on_mesh(comm, 1, 4, 1, tie, vocab_size=250, tie_weights=tie)


@pytest.mark.world_sizes(2, 4)
def test_mesh_puts_tensor_parallel_innermost(comm):
    n, w = comm.Get_size(), comm.Get_rank()
    for tp in (t for t in (1, 2, 4) if n % t == 0):
        for pp in (p for p in (1, 2, 4) if n % (tp * p) == 0):
            grid = mesh(comm, pp=pp, tp=tp)
            dp = n // (tp * pp)
            assert (grid.dp, grid.pp, grid.tp) == (dp, pp, tp)
            assert w == (grid.dp_rank * pp + grid.pp_rank) * tp + grid.tp_rank
            assert grid["tp"] is grid.tp_comm and grid["dp"] is grid.dp_comm and grid["pp"] is grid.pp_comm
            base = w - grid.tp_rank
            assert grid.tp_comm.allgather(w) == list(range(base, base + tp))
            pipeline = w - grid.pp_rank * tp
            assert grid.pp_comm.allgather(w) == [pipeline + s * tp for s in range(pp)]
            position = w % (pp * tp)
            assert grid.dp_comm.allgather(w) == [position + d * pp * tp for d in range(dp)]
            grid.free()


@pytest.mark.mpi_skip  # simulated ranks only: under mpiexec every rank would run all eight again
@pytest.mark.parametrize("layout", LAYOUTS_8, ids=_layout_id)
def test_mesh_of_8_trains_like_one_process(layout):
    simulate(8, train_on_mesh, *layout)


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "nosp"])
def test_fsdp_over_dp_with_tensor_parallel_trains_like_one_process(comm, sequence_parallel, clip):
    """FSDP x TP (torchtitan's layout): FSDP over the dp ranks of tensor-parallel blocks; its clip_grad_norm_
    reads the placements, so a norm weight replicated over the TP ranks counts once."""
    state, ref_losses, ref_norms = reference(clip=clip)
    grid = mesh(comm, dp=2, tp=2)
    model = tensor_parallel(make_model(), grid.tp_comm, sequence_parallel=sequence_parallel)
    placements = {name: placement_of(p) for name, p in model.named_parameters()}
    fsdp = FSDP(model, grid.dp_comm, units=model.fsdp_units())
    opt = AdamW(list(fsdp.parameters()), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (rows(a, grid.dp_rank, 2) for a in global_batch(step))
        opt.zero_grad()
        loss = model.loss(fsdp(x), y)
        loss.backward()
        losses.append(float(np.mean(grid.dp_comm.allgather(float(loss)))))
        if clip:
            norms.append(fsdp.clip_grad_norm_(MAX_NORM))
        opt.step()
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=0, err_msg="losses")
    if clip:
        np.testing.assert_allclose(norms, ref_norms, rtol=TOL, atol=0, err_msg="gradient norms before clipping")
    gathered = fsdp.full_state_dict()
    if grid.dp_rank == 0:  # full_state_dict gathers to the dp group's first rank: this tp rank's slices
        assert list(gathered) == list(placements)
        for name, value in gathered.items():
            assert_slice_matches(value, placements[name], state[name], name)
    else:
        assert gathered == {}
    grid.free()


@pytest.mark.world_sizes(4)
def test_fsdp_over_ranks_holding_different_slices_raises(comm):
    grid = mesh(comm, tp=2)
    model = tensor_parallel(make_model(), grid.tp_comm)
    with pytest.raises(ValueError, match="FSDP: the ranks of its communicator hold different tensor-parallel slices"):
        FSDP(model, comm, units=model.fsdp_units())
    grid.free()


@pytest.mark.world_sizes(2, 4)
def test_clip_grad_norm_counts_replicated_parameters_once(comm):
    x, y = global_batch(0)
    ref = make_model()
    lm_loss(ref(x), y).backward()
    ref_norm = float(nn.clip_grad_norm_(ref.parameters(), MAX_NORM))
    assert ref_norm > MAX_NORM
    model = tensor_parallel(make_model(), comm, sequence_parallel=True)
    model.loss(model(x), y).backward()
    # Premise: adding every rank's squares (a replicated gradient n times) gives another norm.
    squares = sum(float(np.sum(p.grad ** 2)) for p in model.parameters())
    naive = math.sqrt(float(collectives.allreduce(np.array([squares]), comm, op="sum")[0]))
    replicated = [p for p in model.parameters() if isinstance(placement_of(p), Replicate)]
    assert replicated and naive > ref_norm * 1.001
    norm = float(nn.clip_grad_norm_(model.parameters(), MAX_NORM))
    assert norm == pytest.approx(ref_norm, rel=TOL)
    expected = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # clipped by the same scale as the reference
        assert_slice_matches(p.grad, placement_of(p), expected[name].grad, name)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("vocab", [256, 250])  # 250: the gathered logits drop the padding columns
def test_greedy_generate_on_a_split_model_equals_one_process(comm, vocab):
    prompt = np.random.default_rng(7).integers(0, vocab, (2, 3))
    expected = make_model(vocab_size=vocab).generate(prompt, 8, temperature=0)
    model = tensor_parallel(make_model(vocab_size=vocab), comm, sequence_parallel=False)
    np.testing.assert_array_equal(model.generate(prompt, 8, temperature=0), expected)


# -- errors, on every rank, with the sizes ----------------------------------------------------------------------
@pytest.mark.world_sizes(2, 4)
def test_heads_that_do_not_split_raise(comm):
    model = make_model(n_head=3, n_embd=24)
    with pytest.raises(ValueError, match=rf"3 heads do not split over {comm.Get_size()} tensor-parallel ranks"):
        tensor_parallel(model, comm)


@pytest.mark.world_sizes(2, 4)
def test_sequence_parallel_needs_a_divisible_context(comm):
    n = comm.Get_size()
    with pytest.raises(ValueError, match=rf"block_size 5 is not divisible by {n}"):
        tensor_parallel(make_model(block_size=5), comm, sequence_parallel=True)
    # Without sequence parallelism the context is not split: that model converts and runs.
    plain = tensor_parallel(make_model(block_size=5), comm, sequence_parallel=False)
    assert plain(np.zeros((1, 5), dtype=np.int64)).shape == (1, 5, VOCAB // n)


@pytest.mark.world_sizes(2, 4)
def test_sequence_parallel_forward_of_an_uneven_length_raises(comm):
    n = comm.Get_size()
    model = tensor_parallel(make_model(), comm, sequence_parallel=True)
    with pytest.raises(ValueError, match=rf"sequence of {n + 1} tokens does not split over {n} tensor-parallel"):
        model(np.zeros((2, n + 1), dtype=np.int64))


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("bad", [250, 253, -1])  # 253: inside the last rank's padding at tp 4
def test_token_ids_out_of_range_raise_as_in_one_process(comm, bad):
    ids = np.array([[1, bad, 7, 3]])
    with pytest.raises(IndexError, match=r"out of range \[0, 250\)"):
        make_model(vocab_size=250)(ids)
    model = tensor_parallel(make_model(vocab_size=250), comm, sequence_parallel=False)
    values = rf"\(min: {min(1, bad)}, max: {max(7, bad)}\)"
    with pytest.raises(IndexError, match=r"VocabParallelEmbedding: token id out of range \[0, 250\) " + values):
        model(ids)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("bad", [250, 253, -5])
def test_targets_out_of_range_raise_as_in_one_process(comm, bad):
    n, r = comm.Get_size(), comm.Get_rank()
    logits = np.random.default_rng(8).standard_normal((1, 4, 250))
    target = np.array([[1, bad, -100, 3]])
    with pytest.raises(IndexError, match=r"label out of range \[0, 250\)"):
        F.cross_entropy(logits, target)
    local = padded_split(250, n, "test")
    with pytest.raises(IndexError, match=rf"target out of range \[0, 250\) \(min: {min(1, bad)}, max: {max(3, bad)}; "):
        vocab_parallel_cross_entropy(split(logits, "feat", comm, local), target, comm, r * local, 250)


@pytest.mark.world_sizes(2, 4)
def test_converting_a_converted_model_raises(comm):
    model = tensor_parallel(make_model(), comm)
    with pytest.raises(ValueError, match="already split"):
        tensor_parallel(model, comm)


@pytest.mark.world_sizes(2, 4)
def test_ddp_over_ranks_holding_different_slices_raises(comm):
    grid = mesh(comm, tp=2)
    model = tensor_parallel(make_model(), grid.tp_comm)
    with pytest.raises(ValueError, match="different tensor-parallel slices"):
        DDP(model, comm)
    grid.free()


@pytest.mark.world_sizes(2, 4)
def test_mesh_sizes_must_multiply_to_the_world(comm):
    n = comm.Get_size()
    with pytest.raises(ValueError, match=rf"dp=3, pp=1, tp=2, dp\*pp\*tp=6, ranks={n}"):
        mesh(comm, dp=3, tp=2)
    with pytest.raises(ValueError, match=rf"\({n}\) is not divisible by pp \* tp \(pp=1, tp=3, pp\*tp=3\)"):
        mesh(comm, tp=3)
    with pytest.raises(ValueError, match=r"tp must be an int >= 1 \(got 0\)"):
        mesh(comm, tp=0)


def test_parallel_never_imports_models():
    """The model says how it is cut (mpidist.models.tensor_parallel); mpidist.parallel provides only the layers."""
    import ast
    import pathlib

    import mpidist.parallel

    root = pathlib.Path(mpidist.parallel.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and (node.module or "").startswith("models"):
                names = ["mpidist.models"]
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.startswith("mpidist.models")]
    assert offenders == []
    assert not hasattr(mpidist.parallel, "tensor_parallel")


# -- sequence parallelism keeps the column-parallel inputs' shards (Korthikanti et al. 2022, 4.2.2) ------------
DTYPES = {"bfloat16": bfloat16, "float16": np.float16, "float32": np.float32, "float64": np.float64}


def _computed(array):
    """A tensor made by an op that keeps nothing (not a leaf: ``saved_bytes`` excludes leaves as parameters)."""
    leaf = nn.Tensor(array, requires_grad=True)
    return leaf, make_result("Input", array.copy(), (leaf,), lambda g, n: (g,))


def _unfused_column_linear(module):
    """Make ``module`` multiply its column-parallel input as before fusing: ``F.linear(gather_sequence(x))``,
    which keeps the gathered input (a per-instance override: simulated ranks share the class)."""
    def column_linear(x, weight, bias=None):
        return F.linear(gather_sequence(x, module.comm), weight, bias)
    object.__setattr__(module, "column_linear", column_linear)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gather_sequence_linear_equals_gather_then_linear_and_keeps_the_shard(comm, dtype, bias):
    """Output, input, weight and bias gradients EQUAL (bit for bit) those of ``F.linear(gather_sequence(x))``
    and, within rounding, numpy on every rank's shards; the graph keeps the shard, not the gathered input."""
    n, r = comm.Get_size(), comm.Get_rank()
    dt = np.dtype(DTYPES[dtype])
    b, t, f, out_features = 2, 3, 8, 5
    xs = [a.astype(dt) for a in per_rank(70, n, (b, t, f))]
    w = np.random.default_rng(80 + r).standard_normal((out_features, f)).astype(dt)   # this rank's rows
    bv = np.random.default_rng(90 + r).standard_normal(out_features).astype(dt) if bias else None
    results = []
    for fused in (True, False):
        leaf, x = _computed(xs[r].copy())
        weight = nn.Tensor(w.copy(), requires_grad=True)
        bias_t = nn.Tensor(bv.copy(), requires_grad=True) if bias else None
        y = (gather_sequence_linear(x, weight, bias_t, comm) if fused
             else F.linear(gather_sequence(x, comm), weight, bias_t))
        kept = saved_bytes(y)
        g = np.random.default_rng(100 + r).standard_normal(y.shape).astype(y.dtype)
        y.backward(g)
        results.append((y.data, leaf.grad, weight.grad, None if bias_t is None else bias_t.grad, kept))
    (y, gx, gw, gb, kept), (y0, gx0, gw0, gb0, kept0) = results
    for got, want, what in [(y, y0, "output"), (gx, gx0, "input grad"), (gw, gw0, "weight grad"), (gb, gb0, "bias grad")]:
        assert (got is None) == (want is None), what
        if got is not None:
            assert got.dtype == want.dtype, what
            np.testing.assert_array_equal(got, want, err_msg=what)
    assert kept == b * t * f * dt.itemsize and kept0 == n * kept   # the shard; before: the gathered input
    full = np.concatenate(xs, axis=1).astype(np.float64)
    expected = full @ w.astype(np.float64).T + (bv.astype(np.float64) if bias else 0)
    tol = 1e-12 if dt == np.float64 else 1e-5 if dt == np.float32 else 3e-2
    np.testing.assert_allclose(y.astype(np.float64), expected, rtol=tol, atol=tol * 10)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("name", ["column", "attention", "mlp"])
def test_sequence_parallel_column_layers_keep_the_input_shard_not_the_sequence(comm, name):
    """A layer under sequence parallelism keeps what it keeps without it, less the column-parallel linear's input
    of the whole sequence plus its input's shard: b * (t - t / tp) * d * itemsize fewer bytes, EXACTLY."""
    build = LAYERS[name][0]
    n, r = comm.Get_size(), comm.Get_rank()
    for dtype in (np.float32, np.float64):
        x = np.random.default_rng(6).standard_normal((B, S, W))
        kept = {}
        for sequence_parallel in (False, True):
            source = build(np.random.default_rng(3))
            layer = LAYERS[name][1](source, comm, sequence_parallel)
            for p in layer.parameters():
                p.data = p.data.astype(dtype)
            part = x[:, r * S // n:(r + 1) * S // n] if sequence_parallel else x
            kept[sequence_parallel] = saved_bytes(layer(_computed(part.astype(dtype))[1]))
        assert kept[False] - kept[True] == B * (S - S // n) * W * np.dtype(dtype).itemsize, (name, dtype)


GPT_BATCH, GPT_T, GPT_D = 2, 8, 16


def _gpt_step(comm, fused, precision, recompute, bias, dropout):
    """One forward and backward of a 1-block sequence-parallel GPT: (loss, logits, {name: grad}, saved bytes)."""
    model = GPT(GPTConfig(vocab_size=37, block_size=GPT_T, n_layer=1, n_head=4, n_embd=GPT_D, dropout=dropout,
                          bias=bias, dtype=precision[0]), rng=np.random.default_rng(0))
    tensor_parallel(model, comm, sequence_parallel=True)
    if not fused:
        for m in model.modules():
            if isinstance(m, TensorParallelModule):
                _unfused_column_linear(m)
    if recompute != "none":
        model.checkpoint_blocks(mode=recompute)
    if precision[1:]:
        apply_policy(model, Policy(*precision[1:]))
    nn.manual_seed(1000 + comm.Get_rank())   # the same dropout masks in both runs (each TP rank its own stream)
    x = np.random.default_rng(1).integers(0, 37, (GPT_BATCH, GPT_T))
    logits = model(x)
    loss = model.loss(logits, x)
    kept = saved_bytes(loss)
    loss.backward()
    return loss.data, logits.data, {k: p.grad for k, p in model.named_parameters()}, kept


GPT_CASES = [   # (model dtype[, Policy param dtype, compute dtype]), recompute, bias, dropout
    (("float64",), "none", True, 0.0),
    (("float32",), "none", False, 0.0),
    (("float32",), "selective", True, 0.0),
    (("float32",), "full", True, 0.1),
    (("float32", "bfloat16"), "none", True, 0.0),
    (("float32", "float16"), "full", False, 0.0),
    (("float32", "bfloat16", "float32"), "selective", True, 0.0),
]


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("precision,recompute,bias,dropout", GPT_CASES,
                         ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v))
def test_sequence_parallel_gpt_equals_the_unfused_gather_bit_for_bit(comm, precision, recompute, bias, dropout):
    """The split GPT under sequence parallelism (qkv, fc and the head fused with their gathers) gives the loss,
    logits and every gradient of the unfused ``F.linear(gather_sequence(x))`` bit for bit, under precision
    policies and recompute; it keeps (2 per kept block + the head) b * (t - t / tp) * d * itemsize bytes less."""
    n = comm.Get_size()
    state = nn.get_rng_state()   # each run seeds this rank's own dropout stream; later tests see it untouched
    try:
        fused = _gpt_step(comm, True, precision, recompute, bias, dropout)
        unfused = _gpt_step(comm, False, precision, recompute, bias, dropout)
    finally:
        nn.set_rng_state(state)
    np.testing.assert_array_equal(fused[0], unfused[0], err_msg="loss")
    np.testing.assert_array_equal(fused[1], unfused[1], err_msg="logits")
    assert list(fused[2]) == list(unfused[2])
    for name in fused[2]:
        assert fused[2][name].dtype == unfused[2][name].dtype, name
        np.testing.assert_array_equal(fused[2][name], unfused[2][name], err_msg=name)
    activations = precision[-1]   # the Policy's compute dtype (default: its param dtype), else the model's
    itemsize = np.dtype(DTYPES[activations]).itemsize
    kept_blocks = 0 if recompute == "full" else 1
    assert unfused[3] - fused[3] == (2 * kept_blocks + 1) * GPT_BATCH * (GPT_T - GPT_T // n) * GPT_D * itemsize


@pytest.mark.world_sizes(2, 4)
def test_gather_sequence_linear_defers_its_weight_gradient_and_gathers_then(comm):
    """A zero-bubble split (``backward_input`` now, the weight pass, which gathers the shard again, later) gives
    the gradients of one backward, bit for bit."""
    n, r = comm.Get_size(), comm.Get_rank()
    xs = per_rank(110, n, (2, 3, 8))
    w = np.random.default_rng(120 + r).standard_normal((5, 8))
    g = np.random.default_rng(130 + r).standard_normal((2, 3 * n, 5))
    grads = []
    for split_pass in (False, True):
        x = nn.Tensor(xs[r].copy(), requires_grad=True)
        weight, bias = nn.Tensor(w.copy(), requires_grad=True), nn.Tensor(np.ones(5), requires_grad=True)
        y = gather_sequence_linear(x, weight, bias, comm)
        if split_pass:
            (gx,), deferred = backward_input(y, g, [x])
            assert weight.grad is None and bias.grad is None
            deferred.run()
        else:
            y.backward(g)
            gx = x.grad
        grads.append((gx, weight.grad, bias.grad))
    for got, want in zip(*grads):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("policy", [None, "bf16"], ids=["float32", "bf16"])
def test_fsdp_units_are_freed_after_forward_under_sequence_parallelism(monkeypatch, policy):
    """FSDP over tensor- and sequence-parallel blocks frees each unit's gathered parameters after its forward: no
    op keeps a view of them for backward. The norms read their replicated weights through copy_to_tp; a view of
    the gathered flat array kept by a norm kept the whole unit alive (float32 always; bfloat16 since the norms
    keep their 16-bit weights instead of float32 copies)."""
    import gc
    import weakref
    from mpidist.parallel.fsdp import lifecycle
    gathered = []
    start_gather = lifecycle.Unit.start_gather

    def recording_start_gather(unit):
        before = unit.gathered
        start_gather(unit)
        if unit.gathered is not None and unit.gathered is not before:
            gathered.append((unit.label, weakref.ref(unit.gathered)))
    monkeypatch.setattr(lifecycle.Unit, "start_gather", recording_start_gather)

    def run(comm):
        grid = mesh(comm, dp=2, tp=2)
        model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=4, n_embd=16, dropout=0.0,
                              dtype="float32"), rng=np.random.default_rng(0))
        tensor_parallel(model, grid.tp_comm, sequence_parallel=True)
        if policy:
            apply_policy(model, Policy(policy))
        fsdp = FSDP(model, grid.dp_comm, units=model.fsdp_units())
        tokens = np.random.default_rng(1).integers(0, 64, (2, 9))
        loss = model.loss(fsdp(tokens[:, :-1]), tokens[:, 1:])
        comm.Barrier()
        gc.collect()
        alive = sorted({label for label, ref in gathered if ref() is not None and label.startswith("blocks")})
        comm.Barrier()
        loss.backward()
        grid.free()
        return alive
    assert simulate(4, run) == [[]] * 4


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
def test_column_input_is_still_the_full_activation_a_column_layer_reads(comm, sequence_parallel):
    """``TensorParallelModule.column_input`` (what blocks written before ``column_linear`` call): under sequence
    parallelism every rank's shards concatenated along the sequence, else this rank's input; its gradient is
    summed over the ranks (numpy on all ranks' inputs)."""
    n, r = comm.Get_size(), comm.Get_rank()
    xs = per_rank(71, n, (2, 3, 4))
    layer = ColumnParallelLinear(nn.Linear(4, 2 * n, rng=np.random.default_rng(0)), comm, sequence_parallel)
    x = nn.Tensor(xs[r].copy(), requires_grad=True)
    full = layer.column_input(x)
    want = np.concatenate(xs, axis=1) if sequence_parallel else xs[r]
    np.testing.assert_array_equal(full.data, want)
    g = np.ones_like(full.data)
    full.backward(g)
    np.testing.assert_array_equal(x.grad, np.full(xs[r].shape, float(n)))


@pytest.mark.world_sizes(2, 4)
def test_gather_sequence_linear_of_uneven_shards_raises_in_forward_on_every_rank(comm):
    """Shards whose gathered length does not split over the ranks: forward raises on every rank, naming the length
    (backward could not reduce-scatter the input gradient), before backward posts any collective."""
    n, r = comm.Get_size(), comm.Get_rank()
    x = nn.Tensor(np.ones((1, 2 if r == 0 else 1, 3)), requires_grad=True)   # gathered length n + 1
    weight = nn.Tensor(np.ones((2, 3)), requires_grad=True)
    with pytest.raises(ValueError, match=rf"gather_sequence_linear: axis 1 of length {n + 1} does not split evenly "
                                         rf"over {n} tensor-parallel ranks"):
        gather_sequence_linear(x, weight, None, comm)
    assert collectives.allreduce(np.array([1.0]), comm)[0] == n   # the ranks still talk
