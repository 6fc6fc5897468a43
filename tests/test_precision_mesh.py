"""Policy("bf16", "fp32") on a (dp, pp, tp) mesh of 4 ranks against the data-parallel ranks emulated in one process.

Reference: one process's GPT of tests/test_full_state.py with the same policy; each step it runs every emulated
data-parallel rank's share of the batch, takes each rank's bfloat16 gradient, and averages them as DDP's bfloat16
bucket does (each halved, exactly; summed in float32; rounded to bfloat16 once); SGD then updates the float32
masters. Tensor parallelism (and a pipeline's stages) sum float32 partial products in another order than one
process's matmul, so a gradient may round to the neighbouring bfloat16 value (a relative 2**-8 of it): each
tensor is compared within STEPS * LR * (its largest gradient) * 2**-7 plus two bfloat16 steps of its values. A
rank that summed instead of averaging (twice the update: LR * gradient off) would miss by 2**7 times that.

Bitwise (test_bf16_policy_on_a_mesh_equals_the_emulated_ranks_bitwise): Policy("bf16") applied to each rank's
split model, whose bfloat16 activations round the float32 partial sums away where one process rounds; the
reference emulates the pipeline's micro-batches and its tied copies (emulated_bf16). Sequence parallelism with
bfloat16 activations against one process: bitwise but for the layer norms' parameters (stated there).
"""
import numpy as np
import pytest

import test_full_state as full_state_tests
from mpidist import optim
from mpidist.models import GPT, GPTConfig, tensor_parallel
from mpidist.nn.placement import boxes, placement_of
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.parallel import DDP, Pipeline, full_state_dict, mesh

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


# -- sequence parallelism with bfloat16 activations -------------------------------------------------------------
SP_CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=16, dropout=0.0, dtype="float64")
BF16 = Policy("bf16")  # bfloat16 parameters and activations


def sp_batch():
    rng = np.random.default_rng(5)
    return rng.integers(0, SP_CONFIG.vocab_size, (2, SP_CONFIG.block_size)), \
        rng.integers(0, SP_CONFIG.vocab_size, (2, SP_CONFIG.block_size))


def one_process_gradients(policy):
    """Return one process's loss and {name: gradient} of SP_CONFIG's GPT under ``policy``, on sp_batch()."""
    model = GPT(SP_CONFIG, rng=np.random.default_rng(0))
    apply_policy(model, policy)
    x, y = sp_batch()
    loss = model.loss(model(x), y)
    loss.backward()
    return loss.data, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
def test_bf16_activations_under_tensor_and_sequence_parallelism_equal_one_process(comm, sequence_parallel):
    """Policy("bf16") (bfloat16 activations) applied to the split model: the sequence-parallel allgathers and
    reduce-scatters carry bfloat16 (their bits; sums in float32, rounded once), and the loss and every gradient
    slice equal one process's bitwise: a row-parallel layer's partial products are float32 (numpy's bfloat16
    matmul) and round once after the sum, where one process's layer rounds. The float32 loss within 2 ulps.

    Except under sequence parallelism the replicated layer norms' weights and biases: each rank's share of their
    gradient (a sum over its tokens) is a bfloat16 gradient, rounded before copy_to_tp's backward adds the shares
    (in float32, rounded again); one process rounds the whole sum once. The shares can exceed their sum, so the
    difference is measured against the tensor's largest gradient: within 2**-6 of it (seen: up to 2**-7.6)."""
    want_loss, want = one_process_gradients(BF16)
    model = tensor_parallel(GPT(SP_CONFIG, rng=np.random.default_rng(0)), comm, sequence_parallel=sequence_parallel)
    apply_policy(model, BF16)  # after the conversion, which builds new layers: the hooks go on them
    seen = []
    model.blocks[0].register_forward_hook(lambda module, args, out: seen.append(out.data))
    x, y = sp_batch()
    loss = model.loss(model(x), y)
    loss.backward()
    tokens = SP_CONFIG.block_size // comm.Get_size() if sequence_parallel else SP_CONFIG.block_size
    assert seen[0].dtype == bfloat16 and seen[0].shape == (2, tokens, SP_CONFIG.n_embd)  # the residual stream
    # The loss is float32 on both sides; vocab-parallel cross-entropy adds the shards' exp-sums in another order
    # than one process's row sum, which can move the float32 loss by an ulp (seen: 1 ulp at 4 ranks).
    assert loss.data.dtype == np.float32
    assert abs(float(loss.data) - float(want_loss)) <= 2 * np.spacing(np.float32(want_loss)), (loss.data, want_loss)
    rounded_twice = 0
    for name, p in model.named_parameters():
        assert p.grad.dtype == bfloat16, name
        for box in boxes(placement_of(p), p.grad.shape, name=name):
            region = tuple(slice(a, a + n) for a, n in zip(box.offsets, box.sizes))
            got, expected = box.view(p.grad), want[name][region]
            if sequence_parallel and ".ln" in f".{name}":
                bound = 2 ** -6 * float(np.abs(want[name].astype(np.float32)).max())
                np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), rtol=0, atol=bound,
                                           err_msg=name)
                rounded_twice += 1
            else:
                np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16), err_msg=name)
    assert rounded_twice == (6 if sequence_parallel else 0)  # ln1, ln2, ln_f: weight and bias


# -- bitwise on a mesh: Policy("bf16") applied to each rank's split model ----------------------------------------
def emulated_bf16(dp, microbatches, own_head_weight):
    """Return the one-process state after STEPS SGD steps of Policy("bf16") (activations rounded as the split
    model rounds them), the ``dp`` ranks' gradients reduced where and as the mesh reduces them.

    Each emulated rank runs its share in ``microbatches`` parts, each part's loss scaled by its share (a
    pipeline's micro-batches: the bfloat16 gradients add up in place, rounding at each addition); DDP halves
    each rank's gradient (exact) and sums the halves in float32, rounded once. ``own_head_weight``: the head
    holds its own copy of the tied weight (a pipeline's last stage) whose averaged gradient is added to the
    embedding's in float32 and rounded once (Pipeline's tied group), both copies then stepping alike."""
    model = GPT(full_state_tests.CONFIG, rng=np.random.default_rng(0))
    if own_head_weight:
        model.head = model.head.with_own_weight()
    apply_policy(model, BF16)
    named = list(model.named_parameters())
    opt = optim.SGD([p for _, p in named], lr=LR)
    x, y = full_state_tests.batch()
    n = len(x) // dp
    for _ in range(STEPS):
        average = {}
        for r in range(dp):
            opt.zero_grad()
            for k in range(microbatches):
                part = slice(r * n + k * n // microbatches, r * n + (k + 1) * n // microbatches)
                loss = model.loss(model(x[part]), y[part])
                (loss * np.float32(1 / microbatches)).backward()
            for name, p in named:
                half = p.grad * np.asarray(1 / dp, bfloat16)  # exact for dp 2
                average[name] = average.get(name, 0) + half.astype(np.float32)
        for name, p in named:
            p.grad = average[name].astype(bfloat16)
        if own_head_weight:
            tied = (model.embed.wte.weight.grad.astype(np.float32) + model.head.weight.grad.astype(np.float32))
            model.embed.wte.weight.grad = tied.astype(bfloat16)
            model.head.weight.grad = tied.astype(bfloat16)
        opt.step()
    return {name: value for name, value in model.state_dict().items() if name != "head.weight"}


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("dims", [(2, 1, 2), (2, 2, 1)], ids=["dp2_tp2", "dp2_pp2"])
def test_bf16_policy_on_a_mesh_equals_the_emulated_ranks_bitwise(comm, dims):
    """Policy("bf16") applied to each rank's split model (after tensor_parallel or pipeline_stages, which build
    new modules), SGD on a (dp, pp, tp) mesh: bitwise the ranks emulated in one process, rounding where the
    mesh rounds (see emulated_bf16). Tensor parallelism's float32 partial products (numpy's bfloat16 matmul)
    are summed and rounded to bfloat16 once, where one process's layer rounds; a different float32 summation
    order could still flip a rounding tie, which this data does not meet."""
    dp, pp, tp = dims
    grid = mesh(comm, dp=dp, pp=pp, tp=tp)
    model = GPT(full_state_tests.CONFIG, rng=np.random.default_rng(0))
    if tp > 1:
        tensor_parallel(model, grid.tp_comm, sequence_parallel=False)
        apply_policy(model, BF16)
        wrapped = DDP(model, grid.dp_comm)
    else:
        stage = model.pipeline_stages(pp)[grid.pp_rank]
        apply_policy(stage, BF16)
        wrapped = Pipeline(stage, grid.pp_comm, 2, "1f1b", loss_fn=model.loss, dp_comm=grid.dp_comm,
                           tied_parameters=stage.tied)
    opt = optim.SGD(list(wrapped.parameters()), lr=LR)
    x, y = full_state_tests.batch()
    n = len(x) // dp
    mine = slice(grid.dp_rank * n, (grid.dp_rank + 1) * n)
    for _ in range(STEPS):
        opt.zero_grad()
        if pp > 1:
            wrapped.step(x[mine], y[mine])
        else:
            model.loss(wrapped(x[mine]), y[mine]).backward()
        opt.step()
    got = full_state_dict(wrapped, comm, all_ranks=True)
    want = emulated_bf16(dp, pp, own_head_weight=pp > 1)
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        np.testing.assert_array_equal(got[name].view(np.uint8), value.view(np.uint8), err_msg=name)
    if pp > 1:
        for group in wrapped.tied:
            group.free()
    wrapped.remove()
    grid.free()
