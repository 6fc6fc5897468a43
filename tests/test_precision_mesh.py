"""Policy("bf16", "fp32") on a (dp, pp, tp) mesh of 4 ranks against the data-parallel ranks emulated in one process.

Reference: one process's GPT of tests/test_full_state.py with the same policy; each step it runs every emulated
data-parallel rank's share of the batch, takes each rank's bfloat16 gradient, and averages them as DDP's bfloat16
bucket does (each halved, exactly; summed in float32; rounded to bfloat16 once); SGD then updates the float32
masters. Tensor parallelism (and a pipeline's stages) sum float32 partial products in another order than one
process's matmul, so a gradient may round to the neighbouring bfloat16 value (a relative 2**-8 of it): each
tensor is compared within STEPS * LR * (its largest gradient) * 2**-7 plus two bfloat16 steps of its values. A
rank that summed instead of averaging (twice the update: LR * gradient off) would miss by 2**7 times that.
"""
import numpy as np
import pytest

import test_full_state as full_state_tests
from mpidist import optim
from mpidist.models import GPT
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.parallel import full_state_dict

POLICY = Policy("bf16", "fp32")
LR, STEPS = 0.5, 2


def emulated(config, dp):
    """Return the one-process state after STEPS SGD steps, the ``dp`` ranks' gradients averaged as DDP does,
    and each tensor's largest averaged gradient."""
    model = GPT(config, rng=np.random.default_rng(0))
    apply_policy(model, POLICY)
    params = list(model.parameters())
    opt = optim.SGD(params, lr=LR)
    x, y = full_state_tests.batch()
    n = len(x) // dp
    largest = {name: 0.0 for name, _ in model.named_parameters()}
    for _ in range(STEPS):
        total = [np.zeros(p.shape, np.float32) for p in params]
        for r in range(dp):
            opt.zero_grad()
            model.loss(model(x[r * n:(r + 1) * n]), y[r * n:(r + 1) * n]).backward()
            for t, p in zip(total, params):
                assert p.grad.dtype == bfloat16  # the policy's parameters hold bfloat16 gradients
                t += p.grad.astype(np.float32) * np.float32(1 / dp)  # DDP halves in bfloat16: exact (dp 2)
        for t, p, name in zip(total, params, largest):
            p.grad = t.astype(bfloat16)
            largest[name] = max(largest[name], float(np.abs(t).max()))
        opt.step()
    return model.state_dict(), largest


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("dims", [(2, 1, 2), (2, 2, 1)], ids=["dp2_tp2", "dp2_pp2"])
def test_bf16_fp32_policy_on_a_mesh_equals_the_emulated_ranks(comm, dims):
    kind = "mesh"
    layout = full_state_tests.Layout(comm, kind, dims, policy=POLICY)
    layout.opt = optim.SGD(list(layout.wrapped.parameters()), lr=LR)
    start = full_state_dict(layout.wrapped, layout.comm, all_ranks=True)
    layout.train(STEPS)
    got = full_state_dict(layout.wrapped, layout.comm, all_ranks=True)
    want, largest = emulated(full_state_tests.CONFIG, dims[0])
    assert list(got) == list(want)
    moved = False
    for name, value in want.items():
        assert got[name].dtype == value.dtype == bfloat16, name
        a, b, s = (v.astype(np.float64) for v in (got[name], value, start[name]))
        flips = STEPS * LR * largest.get(name, 0.0) * 2 ** -7  # buffers: no gradient, exact
        np.testing.assert_allclose(a, b, rtol=2 ** -7, atol=flips, err_msg=name)
        moved |= bool(np.abs(b - s).max() > 2 ** 6 * flips)
    assert moved  # some tensor moved by far more than its tolerance: a wrong update would show
    layout.close()
