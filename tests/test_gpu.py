"""Real-GPU tests (marker ``gpu``): every collective on every path that works here, and DDP, FSDP and
pipeline training on CuPy arrays against CPU runs, and the nn ops (forward and backward) against numpy.

Skipped unless cupy imports *and* ``cupy.is_available()`` (``import cupy`` succeeds on machines
without a GPU). Meant for ``mpiexec -n 1/2/4 [--oversubscribe] python -m pytest --with-mpi -m gpu
tests/test_gpu.py`` on a GPU machine (docs/gpu.md; first passed on an H100 on 2026-11-27).
"""

import re

import numpy as np
import pytest
from mpi4py import MPI

import mpidist
from mpidist import gpu, nn, optim
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.xp import bfloat16_problem, get_cupy, to_numpy

pytestmark = pytest.mark.gpu

cupy = get_cupy()
if cupy is None or not cupy.is_available():
    pytest.skip("needs cupy and a usable CUDA GPU (cupy.is_available() is false or cupy is missing)",
                allow_module_level=True)

from test_gpu_paths import check_reduction_rules, run_all_collectives  # noqa: E402 - after the skip: it needs nothing from cupy


def to_gpu(module):
    """Move every parameter and buffer of ``module`` to the current GPU (same values)."""
    for _, p in module.named_parameters():
        p.data = cupy.asarray(p.data)
    for m in module.modules():
        for name, b in list(m.named_buffers()):
            if "." not in name:  # m's own buffers; descendants get theirs in their own turn
                setattr(m, name, cupy.asarray(b))
    return module


def test_nn_forward_backward_on_gpu_matches_cpu():
    """Every op family (conv, pools, batch norm, attention, norms, embedding, dropout, cross-entropy with
    ignore_index and label smoothing) on CuPy arrays gives the numpy run's values and gradients."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(0)
            self.conv = nn.Conv2d(2, 4, 3, padding=1, rng=rng, dtype=np.float64)
            self.bn = nn.BatchNorm2d(4, dtype=np.float64)
            self.dw = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4, rng=rng, dtype=np.float64)
            self.pool, self.avg = nn.MaxPool2d(2), nn.AvgPool2d(2, stride=1)
            self.emb = nn.Embedding(10, 8, rng=rng, dtype=np.float64)
            self.block = nn.TransformerBlock(8, 2, mlp_ratio=2, dropout=0.1, rng=rng, dtype=np.float64)
            self.norm = nn.RMSNorm(8, dtype=np.float64)
            self.lift = nn.Linear(4, 8, rng=rng, dtype=np.float64)
            self.head = nn.Linear(8, 10, rng=rng, dtype=np.float64)

        def forward(self, img, tokens):
            h = self.avg(self.pool(nn.functional.relu(self.dw(self.bn(self.conv(img))))))  # (N, 4, 1, 1)
            x = self.emb(tokens) + self.lift(nn.functional.reshape(h, (h.shape[0], 1, 4)))
            return self.head(self.norm(self.block(x)))

    rng = np.random.default_rng(1)
    img, tokens = rng.standard_normal((3, 2, 8, 8)), rng.integers(0, 10, (3, 5))
    target = rng.integers(0, 10, (3, 5))
    target[0, 1] = -1
    results = []
    for to_device in (False, True):
        model = Net()
        if to_device:
            to_gpu(model)
        x = nn.Tensor(cupy.asarray(img) if to_device else img, requires_grad=True)
        mpidist.manual_seed(3)  # the same dropout masks
        out = model(x, cupy.asarray(tokens) if to_device else tokens)
        loss = nn.functional.cross_entropy(out, cupy.asarray(target) if to_device else target, ignore_index=-1,
                                           label_smoothing=0.1)
        loss.backward()
        results.append((float(loss), cupy.asnumpy(x.grad) if to_device else x.grad,
                        {n: (cupy.asnumpy(p.grad) if to_device else p.grad) for n, p in model.named_parameters()},
                        cupy.asnumpy(model.bn.running_var) if to_device else model.bn.running_var))
    (l0, dx0, g0, rv0), (l1, dx1, g1, rv1) = results
    assert l1 == pytest.approx(l0, rel=1e-10)
    np.testing.assert_allclose(dx1, dx0, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(rv1, rv0, rtol=1e-10)
    for name in g0:
        np.testing.assert_allclose(g1[name], g0[name], rtol=1e-8, atol=1e-12, err_msg=name)


# Staged and the automatic choice always run; the others where this machine allows them.
@pytest.mark.parametrize("path", [None, "staged", "cuda_aware", "nccl", "ipc", "hierarchical"])
def test_every_collective_on_every_available_path(comm, path):
    device = gpu.CupyDevice()
    try:
        choice = gpu.attach(comm, device, path=path if comm.Get_size() > 1 else None)
    except RuntimeError as exc:  # raised on every rank alike: the path is impossible here
        if "is not possible" in str(exc):
            pytest.skip(str(exc))
        raise
    try:
        run_all_collectives(comm, device)
        assert gpu.describe(comm) == choice
    finally:
        gpu.release(comm)


@pytest.mark.parametrize("path", [None, "staged", "cuda_aware", "nccl", "ipc", "hierarchical"])
def test_nan_and_float16_rules_on_every_available_path(comm, path):
    """NaN wins max/min and float16 sums accumulate in float32 on CuPy arrays (mpidist.wire's conversions run as
    CuPy kernels; NCCL and cupy reduce the converted buffers)."""
    device = gpu.CupyDevice()
    try:
        gpu.attach(comm, device, path=path if comm.Get_size() > 1 else None)
    except RuntimeError as exc:
        if "is not possible" in str(exc):
            pytest.skip(str(exc))
        raise
    try:
        check_reduction_rules(comm, device)
    finally:
        gpu.release(comm)


def test_large_allreduce_crosses_many_chunks(comm):
    """64 MiB float32 with the default 4 MiB chunks (16 pipelined chunks on the staged path)."""
    n = 16 << 20
    x = cupy.full(n, comm.Get_rank() + 1, dtype=cupy.float32)
    mpidist.allreduce(x, comm)
    size = comm.Get_size()
    assert float(x[0]) == float(x[-1]) == size * (size + 1) / 2
    assert bool((x == size * (size + 1) / 2).all())


def test_ddp_on_gpu_matches_cpu(comm):
    import test_ddp as t

    ddp = t.DDP(to_gpu(t.make_model()), comm, bucket_cap_mb=t.TINY_BUCKET_MB, first_bucket_mb=t.TINY_BUCKET_MB)
    _train_ddp_against_one_process(comm, ddp, t.make_optimizer("adam", ddp.parameters()))


def _train_ddp_against_one_process(comm, ddp, opt, per_rank=5, steps=6):
    """Train ``ddp`` (test_ddp's model on the GPU) with ``opt`` on this rank's slices of test_ddp's global batches,
    and compare with one process's Adam training on the whole batches."""
    import test_ddp as t

    size, rank = comm.Get_size(), comm.Get_rank()
    crit = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = t.global_batch(step, per_rank * size)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        t.train_step(ddp, opt, crit, cupy.asarray(x[sl]), cupy.asarray(y[sl]))
        opt.step()
    assert all(isinstance(p.data, cupy.ndarray) for p in ddp.parameters())
    reference = t.reference_params("adam", steps, lambda s: t.global_batch(s, per_rank * size))
    got = {k: cupy.asnumpy(v) for k, v in ddp.state_dict().items()}
    t.assert_params_equal(got, reference, atol=1e-8)


def test_zero_redundancy_optimizer_on_gpu_matches_cpu(comm):
    """DDP + ZeroRedundancyOptimizer(Adam) on CuPy arrays (its pieces' views and the allgather on the device):
    one process's training on the whole batch, as DDP + Adam is checked above."""
    import test_ddp as t
    from mpidist.parallel import ZeroRedundancyOptimizer

    ddp = t.DDP(to_gpu(t.make_model()), comm)
    _train_ddp_against_one_process(comm, ddp, ZeroRedundancyOptimizer(ddp.parameters(), optim.Adam, comm,
                                                                       chunk_bytes=256, lr=0.01, weight_decay=1e-3))


def test_fsdp_on_gpu_matches_cpu(comm):
    import test_fsdp as t

    ref = t.make_model()
    fsdp = t.FSDP(to_gpu(t.make_model()), comm)
    opt, ref_opt = optim.Adam(fsdp.parameters(), lr=1e-2), optim.Adam(list(ref.parameters()), lr=1e-2)
    for x, y in t.batches(4):
        t.fsdp_step(comm, fsdp, opt, cupy.asarray(x), cupy.asarray(y))
        t.ref_step(ref, ref_opt, x, y)
    with fsdp.summon_full_params() as module:
        for (name, p), (_, q) in zip(module.named_parameters(), ref.named_parameters()):
            np.testing.assert_allclose(cupy.asnumpy(p.data), q.data, rtol=0, atol=1e-8, err_msg=name)


@pytest.mark.world_sizes(2, 3, 4)
def test_pipeline_on_gpu_matches_cpu(comm):
    import test_pipeline as t

    p, rank = comm.Get_size(), comm.Get_rank()
    stage = to_gpu(t.make_stage(rank, p))
    pipe = t.Pipeline(stage, comm, 4, schedule="1f1b", loss_fn=t.CrossEntropyLoss())
    opt = optim.SGD(list(stage.parameters()), lr=t.LR)
    ref = t.Reference(p)
    for step in range(3):
        x, y = t.batch(step, 8)
        stage.zero_grad()
        pipe.step(cupy.asarray(x), cupy.asarray(y))
        ref.step(x, y)
        opt.step()
    for (name, a), (_, b) in zip(stage.named_parameters(), ref.stages[rank].named_parameters()):
        np.testing.assert_allclose(cupy.asnumpy(a.data), b.data, rtol=0, atol=1e-8, err_msg=name)


# -- 16-bit floats on CuPy (issue 30) -------------------------------------------------------------------------
# CuPy has bfloat16 from version 14 (through ml_dtypes, with NumPy >= 2.1.2: CuPy's v14 upgrade guide); where it
# does not, the bfloat16 cases check the error instead.
def cupy_dtypes():
    """The 16-bit dtypes this CuPy holds: float16, and bfloat16 where ``mpidist.xp.bfloat16_problem`` finds it."""
    from test_gpu_paths import SIXTEEN
    return SIXTEEN if bfloat16_problem(cupy) is None else SIXTEEN[:1]


def test_bfloat16_on_this_cupy():
    """CuPy >= 14 holds bfloat16 arrays (a kernel round trip works); an older one raises naming its version."""
    problem = bfloat16_problem(cupy)
    if int(cupy.__version__.split(".")[0]) >= 14:
        assert problem is None, f"CuPy {cupy.__version__}, numpy {np.__version__}: {problem}"
        x = cupy.asarray(np.array([1.0, 257.0, -3.5], np.float32)).astype(bfloat16)
        assert x.dtype == bfloat16 and cupy.asnumpy(x.astype(cupy.float32)).tolist() == [1.0, 256.0, -3.5]
    else:
        with pytest.raises(TypeError, match=f"CuPy {re.escape(cupy.__version__)} has no bfloat16"):
            apply_policy(to_gpu(nn.Linear(2, 2)), Policy("bf16"))


@pytest.mark.parametrize("path", [None, "staged", "cuda_aware", "nccl", "ipc", "hierarchical"])
def test_sixteen_bit_collectives_on_every_available_path(comm, path):
    """float16 (and bfloat16) CuPy arrays: sums in float32 rounded once, copies as 2-byte words; the numpy path's
    bits on every path that works here."""
    from test_gpu_paths import check_sixteen_bit_collectives
    device = gpu.CupyDevice()
    try:
        gpu.attach(comm, device, path=path if comm.Get_size() > 1 else None)
    except RuntimeError as exc:
        if "is not possible" in str(exc):
            pytest.skip(str(exc))
        raise
    try:
        check_sixteen_bit_collectives(comm, device, cupy_dtypes())
    finally:
        gpu.release(comm)


def test_ring16_on_cupy_is_the_numpy_ring(comm):
    from test_gpu_paths import check_ring16_on_device
    check_ring16_on_device(comm, cupy.asarray, cupy_dtypes())


def gpu_pair():
    return (to_gpu, cupy.asarray)


@pytest.mark.parametrize("kind", ["fp16_compress_hook", "bf16_compress_hook", "bf16_params"])
def test_ddp_16_bit_on_gpu_matches_cpu(comm, kind):
    """DDP with the 16-bit hooks (ring staged through the host) and with bfloat16 parameters, two Adam steps on CuPy
    against numpy: GPU float32 matmuls differ from numpy's in the last bits, and a 16-bit rounding of a gradient may
    then go the other way (2**-11 or 2**-8 of it), so the parameters agree within Adam's step times that."""
    from test_gpu_paths import ddp_16_bit_run
    if "bf16" in kind and bfloat16_problem(cupy) is not None:
        pytest.skip(f"CuPy {cupy.__version__} has no bfloat16")
    got, want = ddp_16_bit_run(comm, kind, gpu_pair()), ddp_16_bit_run(comm, kind, None)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        atol = 2e-2 if kind == "bf16_params" else 1e-4  # bfloat16 parameters: one unit in the last place near 1
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=0, atol=atol)


@pytest.mark.parametrize("reduce_dtype", [None, "fp16"], ids=["reduce_fp32", "reduce_fp16"])
def test_fsdp_float16_on_gpu_matches_cpu(comm, reduce_dtype):
    """FSDP(param_dtype=float16), two SGD steps on CuPy against numpy: float16 forward/backward on each (CuPy's
    float16 matmul accumulates in float32, numpy's does not), so within float16's precision of the step."""
    from test_gpu_paths import fsdp_float16_run
    got, want = fsdp_float16_run(comm, reduce_dtype, gpu_pair()), fsdp_float16_run(comm, reduce_dtype, None)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == np.float32
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-2)


@pytest.mark.parametrize("param,compute", [("fp16", None), ("fp16", "fp32"), ("bf16", None)])
def test_policy_on_gpu_matches_cpu(param, compute):
    """Policy on CuPy arrays: 16-bit parameters, float32 masters on the GPU, three Adam steps near numpy's."""
    from test_gpu_paths import train_tiny
    if param == "bf16" and bfloat16_problem(cupy) is not None:
        pytest.skip(f"CuPy {cupy.__version__} has no bfloat16")
    policy = Policy(param, compute)
    runs = []
    for device in (None, gpu_pair()):
        model, opt = train_tiny(MPI.COMM_SELF, lambda m: m, device, steps=3, policy=policy)
        master = opt.state[0]["master_param"]
        assert master.dtype == np.float32 and isinstance(master, cupy.ndarray) == bool(device)
        runs.append([to_numpy(p.data) for p in model.parameters()])
    for g, w in zip(runs[1], runs[0], strict=True):
        assert g.dtype == w.dtype == policy.param_dtype
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=0, atol=2e-2)
