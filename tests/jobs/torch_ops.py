"""Every operation of the mpidist torch backend against a reference computed from every rank's input.

    mpiexec -n N python tests/jobs/torch_ops.py [--desync] [--init mpi|tcp]

Each rank's input is a function of (rank, element), so every rank can compute what every other rank
sent and hence the exact expected result. Exits non-zero with the failing check on any mismatch.
``--desync``: ranks call different ops under MPIDIST_DEBUG=1; every rank must raise DesyncError.
``--init tcp``: torch's own tcp:// rendezvous with rank and world size given, instead of MPI's.
"""

import sys

import torch
import torch.distributed as dist

import mpidist.torch
from mpidist.torch import UnsupportedError

R = dist.ReduceOp
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64,
          torch.uint8, torch.bool, torch.complex64, torch.complex128)


def value(rank, n, dtype, offset=0):
    """Rank ``rank``'s input: small exact values in every dtype."""
    base = torch.arange(n, dtype=torch.float64) + offset
    if dtype == torch.bool:
        return ((base + rank) % 3 == 0)
    if dtype.is_complex:
        return (base + rank + 1j * (rank - base)).to(dtype)
    return ((base % 5) + rank + 1).to(dtype)


def reference(kind, tensors):
    stack = torch.stack([t.to(torch.complex128 if t.dtype.is_complex else torch.float64) for t in tensors])
    if tensors[0].dtype == torch.bool:
        stack = torch.stack(tensors)
        return {R.SUM: stack.any(0), R.MAX: stack.any(0), R.MIN: stack.all(0), R.PRODUCT: stack.all(0)}[kind]
    if kind == R.SUM:
        return stack.sum(0)
    if kind == R.AVG:
        return stack.mean(0)
    if kind == R.PRODUCT:
        return stack.prod(0)
    if kind == R.MIN:
        return stack.min(0).values
    return stack.max(0).values


def check(name, got, want):
    want = want.to(got.dtype) if want.dtype != got.dtype else want
    ok = torch.equal(got, want) if not got.is_floating_point() else torch.allclose(got.double(), want.double(), rtol=1e-2 if got.element_size() == 2 else 1e-12)
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {name}: got {got}, want {want}")


def init():
    """Initialise as --init says: from MPI (default), or torch's own tcp:// rendezvous with rank and size given."""
    how = sys.argv[sys.argv.index("--init") + 1] if "--init" in sys.argv else "mpi"
    if how == "mpi":
        dist.init_process_group("mpidist")
        return
    from mpi4py import MPI
    import socket
    world = MPI.COMM_WORLD
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    dist.init_process_group("mpidist", init_method=f"tcp://127.0.0.1:{port}", rank=world.Get_rank(), world_size=world.Get_size())


def main():
    init()
    rank, n = dist.get_rank(), dist.get_world_size()
    if "--desync" in sys.argv:
        return desync(rank)
    everyone = range(n)
    for dtype in DTYPES:
        kinds = [R.SUM, R.MAX, R.MIN, R.PRODUCT] + ([R.AVG] if dtype.is_floating_point or dtype.is_complex else [])
        if dtype.is_complex:
            kinds = [R.SUM, R.AVG]  # torch itself refuses PRODUCT, MIN and MAX on complex tensors
        for kind in kinds:
            t = value(rank, 5, dtype)
            dist.all_reduce(t, op=kind)
            check(f"all_reduce {kind} {dtype}", t, reference(kind, [value(r, 5, dtype) for r in everyone]))
            t = value(rank, 5, dtype)
            dist.reduce(t, dst=n - 1, op=kind)
            if rank == n - 1:
                check(f"reduce {kind} {dtype}", t, reference(kind, [value(r, 5, dtype) for r in everyone]))
            out = torch.empty(2, dtype=dtype)
            dist.reduce_scatter_tensor(out, value(rank, 2 * n, dtype), op=kind)
            check(f"reduce_scatter_tensor {kind} {dtype}", out, reference(kind, [value(r, 2 * n, dtype) for r in everyone])[2 * rank: 2 * rank + 2])
        b = value(rank, 3, dtype)
        dist.broadcast(b, src=n - 1)
        check(f"broadcast {dtype}", b, value(n - 1, 3, dtype))
        out = torch.empty(3 * n, dtype=dtype)
        dist.all_gather_into_tensor(out, value(rank, 3, dtype))
        check(f"all_gather_into_tensor {dtype}", out, torch.cat([value(r, 3, dtype) for r in everyone]))
        outs = [torch.empty(r + 1, dtype=dtype) for r in everyone]  # uneven sizes
        dist.all_gather(outs, value(rank, rank + 1, dtype))
        for r in everyone:
            check(f"all_gather uneven {dtype} from {r}", outs[r], value(r, r + 1, dtype))
        got = [torch.empty(2, dtype=dtype) for _ in everyone] if rank == 0 else None
        dist.gather(value(rank, 2, dtype), got, dst=0)
        if rank == 0:
            for r in everyone:
                check(f"gather {dtype} from {r}", got[r], value(r, 2, dtype))
        s = torch.empty(2, dtype=dtype)
        dist.scatter(s, [value(0, 2, dtype, offset=10 * r) for r in everyone] if rank == 0 else None, src=0)
        check(f"scatter {dtype}", s, value(0, 2, dtype, offset=10 * rank))
        # all_to_all_single with uneven splits: rank r sends r + j + 1 rows to rank j.
        send_splits = [rank + j + 1 for j in everyone]
        recv_splits = [j + rank + 1 for j in everyone]
        x = value(rank, sum(send_splits), dtype)
        out = torch.empty(sum(recv_splits), dtype=dtype)
        dist.all_to_all_single(out, x, recv_splits, send_splits)
        want = []
        for j in everyone:
            theirs = value(j, sum(j + k + 1 for k in everyone), dtype)
            start = sum(j + k + 1 for k in range(rank))
            want.append(theirs[start: start + j + rank + 1])
        check(f"all_to_all_single uneven {dtype}", out, torch.cat(want))
        outs = [torch.empty(2, dtype=dtype) for _ in everyone]
        dist.all_to_all(outs, [value(rank, 2, dtype, offset=10 * j) for j in everyone])
        for j in everyone:
            check(f"all_to_all {dtype} from {j}", outs[j], value(j, 2, dtype, offset=10 * rank))
        # point to point around a ring; then every rank but 0 sends to 0, received from any source
        req_s = dist.isend(value(rank, 4, dtype), (rank + 1) % n)
        got = torch.empty(4, dtype=dtype)
        dist.recv(got, (rank - 1) % n)
        req_s.wait()
        check(f"send/recv {dtype}", got, value((rank - 1) % n, 4, dtype))
        if rank == 0:
            seen = set()
            for _ in range(n - 1):
                got = torch.empty(4, dtype=dtype)
                src = dist.recv(got)
                check(f"recv any source {dtype} from {src}", got, value(src, 4, dtype))
                seen.add(src)
            assert seen == set(range(1, n)), seen
        else:
            dist.send(value(rank, 4, dtype), 0)
    # bitwise reductions
    for kind, fold in ((R.BAND, lambda a, b: a & b), (R.BOR, lambda a, b: a | b), (R.BXOR, lambda a, b: a ^ b)):
        t = torch.tensor([rank + 1, 7 * rank + 3], dtype=torch.int64)
        dist.all_reduce(t, op=kind)
        want = torch.tensor([1, 3], dtype=torch.int64)
        for r in range(1, n):
            want = fold(want, torch.tensor([r + 1, 7 * r + 3]))
        check(f"all_reduce {kind}", t, want)
    # PREMUL_SUM, scalar and tensor factor
    for factor in (2.5, torch.tensor([0.5], dtype=torch.float64)):
        t = value(rank, 4, torch.float64)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
        f = float(factor) if not isinstance(factor, torch.Tensor) else factor.item()
        check("all_reduce PREMUL_SUM", t, sum(value(r, 4, torch.float64) * f for r in everyone))
    # coalesced forms and non-contiguous tensors
    a, b = value(rank, 3, torch.float64), value(rank, 6, torch.float64).view(2, 3).t()
    dist.all_reduce_coalesced([a, b])
    check("all_reduce_coalesced f64", a, sum(value(r, 3, torch.float64) for r in everyone))
    check("all_reduce non-contiguous f64", b, sum(value(r, 6, torch.float64).view(2, 3).t() for r in everyone))
    outs = [[torch.empty(2), torch.empty(3)] for _ in everyone]  # outs[r][j]: input j of rank r
    dist.all_gather_coalesced(outs, [value(rank, 2, torch.float32), value(rank, 3, torch.float32, offset=7)])
    for r in everyone:
        check(f"all_gather_coalesced from {r}", torch.cat(outs[r]), torch.cat([value(r, 2, torch.float32), value(r, 3, torch.float32, offset=7)]))
    with dist._coalescing_manager(async_ops=True) as cm:
        x1, x2 = value(rank, 2, torch.float32), value(rank, 3, torch.float32)
        dist.all_reduce(x1)
        dist.all_reduce(x2)
    cm.wait()
    check("coalescing_manager", torch.cat([x1, x2]), torch.cat([sum(value(r, 2, torch.float32) for r in everyone),
                                                                 sum(value(r, 3, torch.float32) for r in everyone)]))
    # asynchronous work and futures, several in flight at once, completed out of order
    ts = [value(rank, 1000 * (i + 1), torch.float32) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works[::2]]
    for w in works[::-1]:
        w.wait()
    for i, t in enumerate(ts):
        check(f"async all_reduce {i}", t, sum(value(r, 1000 * (i + 1), torch.float32) for r in everyone))
    for i, f in enumerate(futs):
        check(f"future then {i}", f.wait(), 2 * ts[2 * i])
    assert all(w.is_completed() and w.is_success() for w in works)
    dist.barrier()
    # subgroups and a device mesh map to MPI sub-communicators
    evens = dist.new_group([r for r in everyone if r % 2 == 0])
    if rank % 2 == 0:
        t = torch.ones(2)
        dist.all_reduce(t, group=evens)
        check("new_group evens", t, torch.full((2,), float(len(range(0, n, 2)))))
    if n % 2 == 0:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
        t = torch.ones(1) * rank
        dist.all_reduce(t, group=mesh.get_group("tp"))
        row = [r for r in everyone if r // (n // 2) == rank // (n // 2)]
        check("device mesh tp", t, torch.tensor([float(sum(row))]))
    # another backend beside the default group, meeting in the MPI store
    g = dist.new_group(backend="gloo")
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    check("gloo group beside mpidist", t, torch.tensor([float(n)]))
    # unsupported input: an error naming op, dtype and device, on every rank (same input everywhere)
    for call, words in ((lambda: dist.all_reduce(torch.ones(2, dtype=torch.float8_e4m3fn)), ("all_reduce", "float8_e4m3fn", "cpu")),
                        (lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.AVG), ("AVG", "int32", "cpu")),
                        (lambda: dist.all_reduce(torch.ones(2, dtype=torch.float32), op=R.BAND), ("BAND", "float32", "cpu")),
                        (lambda: dist.all_reduce(torch.ones(2, device="meta")), ("all_reduce", "meta"))):
        try:
            call()
        except (UnsupportedError, RuntimeError, TypeError, ValueError) as exc:
            missing = [w for w in words if w not in str(exc).replace("allreduce", "all_reduce")]
            assert not missing, f"error {exc!r} does not name {missing}"
        else:
            raise AssertionError(f"no error for {words}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: all ops match", flush=True)


def desync(rank):
    """Ranks call different collectives (rank 0 another op, then another size): DesyncError everywhere."""
    raised = []
    try:
        if rank == 0:
            dist.broadcast(torch.ones(4), 0)
        else:
            dist.all_reduce(torch.ones(4))
    except mpidist.torch.DesyncError as exc:
        raised.append(str(exc))
    try:
        dist.all_reduce(torch.ones(4 + (rank == 1)))
    except mpidist.torch.DesyncError as exc:
        raised.append(str(exc))
    assert len(raised) == 2, raised
    print(f"rank {rank}: desync raised: {raised[0]} | {raised[1]}", flush=True)


if __name__ == "__main__":
    main()
