"""Real-GPU tests (marker ``gpu``): every collective on every path that works here, and DDP, FSDP and
pipeline training on CuPy arrays against CPU runs, and the nn ops (forward and backward) against numpy.

Skipped unless cupy imports *and* ``cupy.is_available()`` (``import cupy`` succeeds on machines
without a GPU). Meant for ``mpiexec -n 1/2/4 [--oversubscribe] python -m pytest --with-mpi -m gpu
tests/test_gpu.py`` on a GPU machine (docs/gpu.md; first passed on an H100 on 2026-11-27).
"""

import numpy as np
import pytest

import mpidist
from mpidist import gpu, nn, optim
from mpidist.xp import get_cupy

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

    size, rank = comm.Get_size(), comm.Get_rank()
    per_rank, steps = 5, 6
    ddp = t.DDP(to_gpu(t.make_model()), comm, bucket_cap_mb=t.TINY_BUCKET_MB, first_bucket_mb=t.TINY_BUCKET_MB)
    opt = t.make_optimizer("adam", ddp.parameters())
    crit = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = t.global_batch(step, per_rank * size)
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad()
        t.train_step(ddp, opt, crit, cupy.asarray(x[sl]), cupy.asarray(y[sl]))
        opt.step()
    reference = t.reference_params("adam", steps, lambda s: t.global_batch(s, per_rank * size))
    got = {k: cupy.asnumpy(v) for k, v in ddp.state_dict().items()}
    t.assert_params_equal(got, reference, atol=1e-8)


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
