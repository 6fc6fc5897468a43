"""ZeroRedundancyOptimizer: the optimizer state split over data-parallel ranks, stepping bit for bit like the plain
optimizer (which a single process on the whole batch checks in turn), under DDP and a Pipeline's replicas, in
float64 and with bfloat16 parameters and float32 masters; checkpoints that move state between it and the plain
optimizer at any size; errors on every rank."""
import copy

import numpy as np
import pytest

import mpidist
from mpidist import checkpoint, nn, optim
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.parallel import DDP, Pipeline, ZeroRedundancyOptimizer, mesh
from mpidist.parallel.zero import allgather_calls, shard_bounds, shard_width

IN, HIDDEN, OUT = 5, 7, 3


def make_model(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng, dtype=dtype), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN, rng=rng, dtype=dtype), nn.GELU(),
                         nn.Linear(HIDDEN, OUT, rng=rng, dtype=dtype))


def batch(step, n):
    rng = np.random.default_rng([7, step])
    return rng.standard_normal((n, IN)), rng.integers(0, OUT, size=n)


OPTIMIZERS = {"sgd": (optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
              "adam": (optim.Adam, dict(lr=0.01, weight_decay=1e-3)),
              "adamw": (optim.AdamW, dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1))}


def groups(model):
    """Two groups, as GPT training makes them: matrices decayed, biases not."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.data.ndim > 1]},
            {"params": [p for p in params if p.data.ndim == 1], "weight_decay": 0.0}]


def make_optimizer(sharded, params, cls, comm, **kw):
    """``cls`` over ``params``, its state split over ``comm`` (ZeroRedundancyOptimizer) when ``sharded``."""
    return ZeroRedundancyOptimizer(params, cls, comm, **kw) if sharded else cls(params, **kw)


def train(model, opt, comm, steps, per_rank=4, start=0):
    crit = nn.CrossEntropyLoss()
    size, rank = (1, 0) if comm is None else (comm.Get_size(), comm.Get_rank())
    for step in range(start, start + steps):
        x, y = batch(step, per_rank * size)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        crit(model(nn.Tensor(x[mine])), y[mine]).backward()
        opt.step()


def test_shards_tile_every_parameter_and_the_calls_carry_them():
    """Formula checks: a parameter's shards over N ranks are disjoint, in order, cover it, and none is longer than
    ceil(n / N); a bucket's allgathers carry sum(ceil(n / N)) elements per rank in chunks of chunk_bytes."""
    for n in (1, 2, 5, 7, 64, 1000):
        for size in (1, 2, 3, 4, 7):
            bounds = [shard_bounds(n, size, r) for r in range(size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
            assert max(hi - lo for lo, hi in bounds) == -(-n // size) == bounds[0][1]
    for sizes in ([1], [5, 7, 64], [1000, 3, 3]):
        for size in (1, 2, 3, 4, 7):
            width = shard_width(sizes, size)
            assert width == sum(shard_bounds(n, size, 0)[1] for n in sizes)
            for itemsize, chunk in ((8, 16), (2, 4), (8, 10**9)):
                calls = allgather_calls(width, itemsize, chunk)
                assert sum(calls) == width and max(calls) <= max(1, chunk // itemsize)


def owned(params, comm):
    """This rank's elements: its shard of every parameter."""
    return sum(hi - lo for lo, hi in (shard_bounds(p.data.size, comm.Get_size(), comm.Get_rank()) for p in params))


@pytest.mark.world_sizes(1, 2, 3, 4)
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_ddp_with_sharded_state_steps_bit_for_bit_like_the_plain_optimizer(comm, kind):
    """DDP + ZeroRedundancyOptimizer equals DDP + the plain optimizer bit for bit every step (two groups, chunks
    of 40 bytes: several allgathers per bucket), and both equal one process on the global batch; the state is
    split: the ranks' state bytes add up to the plain optimizer's."""
    cls, kw = OPTIMIZERS[kind]
    sharded_model, plain_model = DDP(make_model(), comm), DDP(make_model(), comm)
    sharded = ZeroRedundancyOptimizer(groups(sharded_model), cls, comm, chunk_bytes=40, **kw)
    plain = cls(groups(plain_model), **kw)
    for step in range(4):
        train(sharded_model, sharded, comm, 1, start=step)
        train(plain_model, plain, comm, 1, start=step)
        for (k, a), b in zip(sharded_model.state_dict().items(), plain_model.state_dict().values()):
            np.testing.assert_array_equal(a, b, err_msg=f"step {step} {k}")
    reference = make_model()
    ref_opt = cls(groups(reference), **kw)
    for step in range(4):   # one process, the whole global batch
        x, y = batch(step, 4 * comm.Get_size())
        ref_opt.zero_grad()
        nn.CrossEntropyLoss()(reference(nn.Tensor(x)), y).backward()
        ref_opt.step()
    for k, v in reference.state_dict().items():
        np.testing.assert_allclose(sharded_model.state_dict()[k], v, rtol=0, atol=1e-12, err_msg=k)
    plain_bytes = sum(v.nbytes for s in plain.state.values() for v in s.values() if hasattr(v, "nbytes"))
    assert sum(comm.allgather(sharded.state_bytes())) == plain_bytes
    n = sum(p.data.size for p in sharded_model.parameters())
    assert sharded.state_bytes() == plain_bytes // n * owned(sharded_model.parameters(), comm)


@pytest.mark.world_sizes(2, 4)
def test_bfloat16_parameters_keep_float32_masters_of_their_shard_only(comm):
    """A bfloat16 Policy: the plain AdamW keeps a float32 master and two moments per parameter; sharded, each rank
    keeps them for its shard, and the parameters stay bit for bit the plain optimizer's (masters rounded alike)."""
    models = []
    for _ in range(2):
        model = make_model()
        apply_policy(model, Policy("bf16"))
        models.append(DDP(model, comm))
    assert all(p.data.dtype == bfloat16 for p in models[0].parameters())
    sharded = ZeroRedundancyOptimizer(models[0].parameters(), optim.AdamW, comm, lr=0.01, weight_decay=0.1)
    plain = optim.AdamW(models[1].parameters(), lr=0.01, weight_decay=0.1)
    train(models[0], sharded, comm, 3)
    train(models[1], plain, comm, 3)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        np.testing.assert_array_equal(a.data.view(np.uint16), b.data.view(np.uint16))
    assert sharded.state_bytes() == 12 * owned(models[0].parameters(), comm)   # float32 master and moments
    assert all(s["master_param"].dtype == np.float32 for s in sharded.state.values())


@pytest.mark.world_sizes(4)
def test_pipeline_replicas_shard_their_stages_state(comm):
    """dp=2 x pp=2: each stage's optimizer state is split over its two replicas (the mesh's dp_comm); the stages
    train bit for bit like with the plain optimizer."""
    m = mesh(comm, dp=2, pp=2)
    rng = np.random.default_rng(3)
    layers = [nn.Sequential(nn.Linear(IN, HIDDEN, rng=rng, dtype=np.float64), nn.Tanh()),
              nn.Sequential(nn.Linear(HIDDEN, OUT, rng=rng, dtype=np.float64))]
    runs = []
    for sharding in (True, False):
        stage = copy.deepcopy(layers[m.pp_rank])
        pipe = Pipeline(stage, m.pp_comm, 2, loss_fn=nn.CrossEntropyLoss(), dp_comm=m.dp_comm)
        params = list(stage.parameters())
        opt = make_optimizer(sharding, params, optim.AdamW, m.dp_comm, lr=0.02)
        for step in range(3):
            x, y = batch(step, 8)
            mine = slice(m.dp_rank * 4, (m.dp_rank + 1) * 4)
            opt.zero_grad()
            pipe.step(x[mine], y[mine])
            opt.step()
        runs.append([p.data.copy() for p in params])
        if sharding:   # exp_avg and exp_avg_sq of the shard (float64)
            assert opt.state_bytes() == 2 * 8 * owned(params, m.dp_comm)
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    m.free()


def shared_dir(comm, tmp_path):
    return comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)


def _train_and_save(comm, root, sharded):
    model = DDP(make_model(), comm)
    opt = make_optimizer(sharded, groups(model), optim.AdamW, comm, lr=0.01, weight_decay=0.1)
    train(model, opt, comm, 3, per_rank=12 // comm.Get_size())
    checkpoint.save(root, {"model": model, "optim": opt}, comm, step=3)
    return {k: v.copy() for k, v in model.state_dict().items()}


@pytest.mark.mpi_skip
@pytest.mark.parametrize("saved_at,saved_sharded,loaded_at,sharded", [
    (4, True, 1, False), (4, True, 3, True), (3, True, 2, True), (1, True, 4, True), (2, False, 4, True),
    (4, False, 3, True)])
def test_checkpoints_move_state_between_sizes_and_to_and_from_the_plain_optimizer(tmp_path, saved_at, saved_sharded,
                                                                                     loaded_at, sharded):
    """Saved at one size, sharded or plain, loaded at another, sharded or plain: training continues as one process
    that never stopped (global batch 12, float64), the hyperparameters restored from the checkpoint."""
    root = str(tmp_path)
    mpidist.simulate(saved_at, _train_and_save, root, saved_sharded)

    def resume(comm):
        model = DDP(make_model(seed=9), comm)
        opt = make_optimizer(sharded, groups(model), optim.AdamW, comm, lr=0.5, weight_decay=0.0)
        assert checkpoint.load(root, {"model": model, "optim": opt}, comm) == 3
        train(model, opt, comm, 2, per_rank=12 // comm.Get_size(), start=3)
        return {k: v.copy() for k, v in model.state_dict().items()}

    got = mpidist.simulate(loaded_at, resume)[0]
    reference = make_model()
    ref_opt = optim.AdamW(groups(reference), lr=0.01, weight_decay=0.1)
    train(reference, ref_opt, None, 5, per_rank=12)
    for k, v in reference.state_dict().items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-12, err_msg=k)


@pytest.mark.world_sizes(2)
def test_own_state_dict_round_trips_and_refuses_another_layout(comm):
    model = DDP(make_model(), comm)
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.Adam, comm, lr=0.01)
    train(model, opt, comm, 2)
    saved = opt.state_dict()
    twin_model = DDP(make_model(), comm)
    twin = ZeroRedundancyOptimizer(twin_model.parameters(), optim.Adam, comm, lr=0.01)
    twin_model.load_state_dict(model.state_dict())
    twin.load_state_dict(saved)
    train(model, opt, comm, 1, start=2)
    train(twin_model, twin, comm, 1, start=2)
    for a, b in zip(model.parameters(), twin_model.parameters()):
        np.testing.assert_array_equal(a.data, b.data)
    other = dict(saved, zero=dict(saved["zero"], rank=1 - comm.Get_rank()))
    with pytest.raises(ValueError, match=rf"the state is of rank {1 - comm.Get_rank()} of 2, this is rank "
                                         rf"{comm.Get_rank()} of 2"):
        twin.load_state_dict(other)


@pytest.mark.world_sizes(2, 3)
def test_bad_input_raises_on_every_rank(comm):
    rank = comm.Get_rank()
    params = list(make_model().parameters())
    with pytest.raises(TypeError, match=r"ZeroRedundancyOptimizer: ranks .*optimizer_class must be an "
                                        r"mpidist.optim.Optimizer subclass"):
        ZeroRedundancyOptimizer(params, object, comm, lr=0.1)
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: rank 1: ValueError: .*invalid hyperparameters"):
        ZeroRedundancyOptimizer(params, optim.Adam, comm, lr=0.1 if rank != 1 else -1.0)
    with pytest.raises(TypeError, match=r"parameter group 1 has options \['momentum'\] that AdamW does not take"):
        ZeroRedundancyOptimizer([{"params": params[:2]}, {"params": params[2:], "momentum": 0.9}], optim.AdamW,
                                comm, lr=0.1)
    with pytest.raises(ValueError, match=r"chunk_bytes must be an int >= 1 \(got 0\)"):
        ZeroRedundancyOptimizer(params, optim.SGD, comm, chunk_bytes=0, lr=0.1)
    # Different models on different ranks: named with each rank's bucket, on every rank (no hang)
    mine = params if rank == 0 else params[:-1]
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: ranks disagree at entry \(bucket, optimizer, group\) 0"):
        ZeroRedundancyOptimizer(mine, optim.SGD, comm, lr=0.1)


@pytest.mark.world_sizes(2, 3)
def test_a_parameter_without_a_gradient_is_skipped_as_the_plain_optimizer_skips_it(comm):
    """Its pieces keep their values and state (AdamW's decay and moments do not touch it), bit for bit as plain."""
    runs = []
    for sharding in (True, False):
        params = list(make_model().parameters())
        opt = make_optimizer(sharding, params, optim.AdamW, comm, lr=0.1, weight_decay=0.1)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = None if (i == 1 and step > 0) else np.full_like(p.data, 0.1 * (step + 1))
            opt.step()
        runs.append([p.data.copy() for p in params])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.world_sizes(2)
def test_learning_rate_schedules_drive_the_shards(comm):
    """A LambdaLR on the sharded optimizer sets the rate its shards step with: equal to the plain optimizer's."""
    runs = []
    for sharding in (True, False):
        model = DDP(make_model(), comm)
        opt = make_optimizer(sharding, model.parameters(), optim.AdamW, comm, lr=0.05)
        schedule = optim.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        for step in range(3):
            train(model, opt, comm, 1, start=step)
            schedule.step()
        runs.append([p.data.copy() for p in model.parameters()])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.world_sizes(2)
def test_elastic_state_refuses_it_with_the_alternatives(comm):
    """Elastic training rebuilds over the survivors, whose split the shards would not follow: refused at once, as an
    instance or from a factory, naming what to use instead."""
    from mpidist.elastic.state import State
    model = make_model()
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, comm, lr=0.01)
    with pytest.raises(TypeError, match=r"State: ZeroRedundancyOptimizer splits its state over the communicator it "
                                        r"was built on; .* use the plain optimizer with DDP, or FSDP"):
        State(model, opt)
    state = State(model, lambda params: ZeroRedundancyOptimizer(params, optim.AdamW, comm, lr=0.01))
    with pytest.raises(TypeError, match=r"State: ZeroRedundancyOptimizer splits its state"):
        state.start(lambda c: DDP(model, c), comm)


@pytest.mark.world_sizes(2)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning", "ignore:overflow:RuntimeWarning")
def test_grad_scaler_unscales_the_models_gradients_for_it(comm):
    """float16 parameters under a GradScaler: ``unscale_`` reaches the model's gradients (not the shards'), so the
    sharded run stays bit for bit the plain one, skipped steps included (the first scale overflows float16)."""
    from mpidist.amp import GradScaler
    runs = []
    for sharding in (True, False):
        model = make_model()
        apply_policy(model, Policy("fp16"))
        model = DDP(model, comm)
        opt = make_optimizer(sharding, model.parameters(), optim.AdamW, comm, lr=0.01)
        scaler = GradScaler(init_scale=2.0 ** 20, backoff_factor=2.0 ** -6, growth_interval=1)
        stepped = []
        for step in range(4):
            x, y = batch(step, 8)
            mine = slice(comm.Get_rank() * 4, comm.Get_rank() * 4 + 4)
            opt.zero_grad()
            scaler.scale(nn.CrossEntropyLoss()(model(nn.Tensor(x[mine])), y[mine])).backward()
            stepped.append(scaler.step(opt))
            scaler.update()
        runs.append(([p.data.copy() for p in model.parameters()], stepped))
    assert runs[0][1] == runs[1][1] and not all(runs[0][1]) and any(runs[0][1])
    for a, b in zip(runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


@pytest.mark.world_sizes(2)
def test_full_optimizer_state_dict_points_to_checkpoints(comm):
    from mpidist.parallel import full_optimizer_state_dict
    model = DDP(make_model(), comm)
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, comm, lr=0.01)
    train(model, opt, comm, 1)
    with pytest.raises(ValueError, match=r"full_optimizer_state_dict: ranks 0,1: TypeError: ZeroRedundancyOptimizer "
                                         r"keeps flat shards .* mpidist.checkpoint saves it"):
        full_optimizer_state_dict(model, opt, comm=comm)


@pytest.mark.world_sizes(2)
def test_groups_given_as_generators_are_read_once_and_kept(comm):
    """``{"params": module.parameters()}`` (a generator): the groups keep every parameter and train as plain does."""
    runs = []
    for sharding in (True, False):
        model = DDP(make_model(), comm)
        groups = [{"params": (p for p in model.parameters() if p.data.ndim > 1), "lr": 0.05},
                  {"params": (p for p in model.parameters() if p.data.ndim == 1)}]
        opt = make_optimizer(sharding, groups, optim.SGD, comm, lr=0.1)
        assert sum(len(g["params"]) for g in opt.param_groups) == 6
        train(model, opt, comm, 2)
        runs.append([p.data.copy() for p in model.parameters()])
    assert not np.array_equal(runs[0][0], make_model().state_dict()["0.weight"])
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)


@pytest.mark.world_sizes(2)
def test_shards_or_slices_instead_of_replicas_are_refused_on_every_rank(comm):
    """Over FSDP's shards (equal shapes, different values) the first step refuses, on every rank, before any
    value is overwritten; over ranks holding different tensor-parallel slices construction refuses."""
    from mpidist.parallel import FSDP
    from mpidist.nn.placement import Shard, set_placement
    fsdp = FSDP(make_model(), comm)
    opt = ZeroRedundancyOptimizer(fsdp.parameters(), optim.SGD, comm, lr=0.1)
    before = [p.data.copy() for p in fsdp.parameters()]
    train(fsdp, opt, comm, 0)
    x, y = batch(0, 4)
    opt.zero_grad()
    nn.CrossEntropyLoss()(fsdp(nn.Tensor(x)), y).backward()
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer.step: the ranks of its communicator hold different "
                                         r"values of the parameters at the first step; .* not of FSDP's shards"):
        opt.step()
    for a, b in zip(before, fsdp.parameters()):
        np.testing.assert_array_equal(a, b.data)
    rank = comm.Get_rank()
    slices = [set_placement(nn.Parameter(np.zeros((2, 3))), Shard(0, comm, (4, 3), 2 * rank))]
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: the ranks of its communicator hold different "
                                         r"tensor-parallel slices"):
        ZeroRedundancyOptimizer(slices, optim.SGD, comm, lr=0.1)


@pytest.mark.world_sizes(2, 3)
def test_a_failed_update_on_one_rank_raises_on_every_rank_after_the_exchange(comm):
    """Rank 1's update raises: every rank raises naming it (none waits in the allgather), and the replicas still
    hold equal values (every rank's shard as it stood); the next step works."""
    model = DDP(make_model(), comm)
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, comm, lr=0.01)
    train(model, opt, comm, 1)
    if comm.Get_rank() == 1:
        real = opt.inner._step

        def boom():
            opt.inner._step = real
            raise FloatingPointError("overflow in the update")
        opt.inner._step = boom
    with pytest.raises(RuntimeError, match=r"ZeroRedundancyOptimizer.step: the update failed on rank 1 \(this rank: "
                                           + ("FloatingPointError: overflow in the update" if comm.Get_rank() == 1
                                              else "updated") + r"\)"):
        train(model, opt, comm, 1, start=1)
    values = [_digest_of(model)]
    assert len(set(comm.allgather(values[0]))) == 1
    train(model, opt, comm, 1, start=2)
    assert len(set(comm.allgather(_digest_of(model)))) == 1


def _digest_of(model):
    return b"".join(p.data.tobytes() for p in model.parameters())


@pytest.mark.world_sizes(2)
def test_every_rank_must_agree_on_chunks_optimizer_and_group_options(comm):
    rank = comm.Get_rank()
    params = list(make_model().parameters())
    with pytest.raises(ValueError, match=r"ranks disagree at entry \(bucket, optimizer, group\) 1: rank 0: .*'optimizer', 'SGD', 64.*rank 1: "
                                         r".*'optimizer', 'SGD', 128"):
        ZeroRedundancyOptimizer(params, optim.SGD, comm, chunk_bytes=64 * (1 + rank), lr=0.1)
    with pytest.raises(ValueError, match=r"ranks disagree at entry \(bucket, optimizer, group\) 1: rank 0: .*'Adam'.*rank 1: .*'AdamW'"):
        ZeroRedundancyOptimizer(params, optim.Adam if rank == 0 else optim.AdamW, comm, lr=0.1)
    with pytest.raises(ValueError, match=r"ranks disagree at entry \(bucket, optimizer, group\) 2: rank 0: .*'lr', '0\.1'.*rank 1: .*'lr', '0\.2'"):
        ZeroRedundancyOptimizer(params, optim.SGD, comm, lr=0.1 * (1 + rank))


@pytest.mark.world_sizes(2)
def test_steps_count_in_the_parameters_versions_as_plain_steps_do(comm):
    """Each step counts once in every parameter with a gradient (what the step stamp of DDP's desync check reads)."""
    versions = []
    for sharding in (True, False):
        model = DDP(make_model(), comm)
        opt = make_optimizer(sharding, model.parameters(), optim.SGD, comm, lr=0.1)
        train(model, opt, comm, 3)
        versions.append([p.version for p in model.parameters()])
    assert versions[0] == versions[1] and min(versions[0]) >= 3


@pytest.mark.mpi_skip
def test_a_pipelines_tied_weight_checkpoints_and_loads_into_the_plain_optimizer(tmp_path):
    """A GPT on a 2 x 2 (dp, pp) mesh with its tied embedding (a copy on the first and the last stage, each split
    over its own replicas): saved with ZeRO-1 and with plain AdamW after the same steps, each loads into one
    process's model and AdamW, and the two give the same parameters and state, bit for bit."""
    from mpidist.plan import Layout, ModelShape
    from mpidist.plan.execute import LayoutRun
    shape = ModelShape(layers=2, hidden=16, heads=2, vocab=32, seq=8)
    roots = {kind: str(tmp_path / kind) for kind in ("zero1", "ddp")}

    def save(comm, kind):
        run = LayoutRun(shape, Layout(2, 1, 2, kind, num_micro=2, schedule="1f1b"), comm)
        run.step()
        run.step()
        checkpoint.save(roots[kind], {"model": run.wrapper, "optim": run.opt}, comm, step=2)

    loaded = {}
    for kind in roots:
        mpidist.simulate(4, save, kind)

        def load(comm, kind=kind):
            run = LayoutRun(shape, Layout(1, 1, 1), comm, seed=5)
            checkpoint.load(roots[kind], {"model": run.wrapper, "optim": run.opt}, comm)
            return ({k: v.copy() for k, v in run.wrapper.state_dict().items()},
                    {i: {k: v.copy() for k, v in s.items() if hasattr(v, "copy")} for i, s in run.opt.state.items()})
        loaded[kind] = mpidist.simulate(1, load)[0]
    (params_z, state_z), (params_d, state_d) = loaded["zero1"], loaded["ddp"]
    assert params_z.keys() == params_d.keys() and state_z.keys() == state_d.keys() and state_z
    for k in params_d:
        np.testing.assert_array_equal(params_z[k], params_d[k], err_msg=k)
    for i in state_d:
        for k in state_d[i]:
            np.testing.assert_array_equal(state_z[i][k], state_d[i][k], err_msg=f"{i} {k}")


@pytest.mark.world_sizes(2, 3)
def test_ddp_join_needs_it_and_with_it_uneven_batches_finish(comm):
    """Without ``optimizer=`` DDP.join refuses on every rank (a joined rank would miss its allgathers and the
    others wait forever); with it, ranks with fewer batches step it in the shadow and the replicas stay equal."""
    model = DDP(make_model(), comm)
    opt = ZeroRedundancyOptimizer(model.parameters(), optim.AdamW, comm, lr=0.01)
    with pytest.raises(ValueError, match=r"DDP.join: a ZeroRedundancyOptimizer steps this model's parameters .* "
                                         r"join\(optimizer=opt\)"):
        with model.join():
            pass
    with model.join(optimizer=opt):
        train(model, opt, comm, 1 + comm.Get_rank())   # rank r takes r + 1 steps
    assert len(set(comm.allgather(b"".join(p.data.tobytes() for p in model.parameters())))) == 1
