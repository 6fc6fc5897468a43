"""Selective activation recompute (``GPT.checkpoint_blocks(mode="selective")``, Korthikanti et al. 2205.05198).

Backward recomputes each block's attention probabilities (and dropout mask) from the kept q, k instead of
keeping them. Checked against independent references: gradients bitwise equal to keeping them (the same
operations on the same inputs), central finite differences of the loss along a random direction, training
parity with one process under DDP, FSDP and a pipeline (SimComm and mpiexec), one step under tensor and
sequence parallelism against one process's gradients; and the bytes the autograd graph keeps drop by exactly
batch x heads x seq^2 x itemsize per block (x2 with dropout: the mask), counted by walking the graph.
"""
import numpy as np
import pytest

import mpidist
from gradcheck import gradcheck
from mpidist import nn
from mpidist.models import GPT, GPTConfig, lm_loss, tensor_parallel
from mpidist.nn import functional as F
from mpidist.nn.placement import placement_of
from mpidist.nn.precision import bfloat16
from mpidist.parallel import DDP, FSDP
from test_autograd import saved_bytes
from test_gpt import (STEPS, assert_history_matches, assert_stages_match, assert_state_matches, count_block_forwards,
                      data_parallel_train, full_state, pipeline_train, reference, reference_model)
from test_gpt import make_model as make_gpt
from test_tensor_parallel import assert_slice_matches, global_batch


def tiny(dropout=0.0, dtype="float64", n_layer=2, mode=None):
    model = GPT(GPTConfig(vocab_size=37, block_size=8, n_layer=n_layer, n_head=4, n_embd=16, dropout=dropout,
                          dtype=dtype), rng=np.random.default_rng(0))
    return model.checkpoint_blocks(mode=mode) if mode else model


def probs_bytes(model, batch, t, dropout):
    """Bytes of one model's attention probabilities (and dropout masks, one byte per element: booleans, as
    Megatron-LM keeps them) for ``batch`` sequences of ``t``: the arrays selective recompute does not keep."""
    c = model.config
    return c.n_layer * batch * c.n_head * t * t * (np.dtype(c.dtype).itemsize + (1 if dropout else 0))


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["nodrop", "dropout"])
def test_selective_gradients_equal_keeping_the_probabilities_and_hold_fewer_bytes(dropout):
    x = np.random.default_rng(1).integers(0, 37, (3, 8))
    got = {}
    for mode in (None, "selective"):
        model = tiny(dropout, mode=mode)
        mpidist.manual_seed(7)
        loss = lm_loss(model(x), x)
        held = saved_bytes(loss)
        after_forward = nn.default_generator().bit_generator.state
        loss.backward()
        # The recompute draws the forward's masks again and leaves the generator where the forward left it.
        assert nn.default_generator().bit_generator.state == after_forward
        got[mode] = (float(loss), held, {n: p.grad for n, p in model.named_parameters()})
    (loss0, held0, g0), (loss1, held1, g1) = got[None], got["selective"]
    assert loss1 == loss0
    for name, g in g0.items():
        np.testing.assert_array_equal(g1[name], g, err_msg=name)
    assert held0 - held1 == probs_bytes(model, 3, 8, dropout)


@pytest.mark.parametrize("case", ["causal-chunks", "mask", "dropout", "float32", "bfloat16-causal-chunks",
                                  "float16-mask", "bfloat16-dropout"])
def test_multi_head_attention_recompute_probs_is_bitwise_the_kept_one(case):
    """The op itself: sequence slices (6 sequences of 4 per slice at h 8, t 64: _SCORES_CHUNK), an additive mask,
    dropout from an own generator, float32; and 16-bit, whose kept probabilities are rounded to 16 bits (the
    recompute rounds the same float32 softmax the same way)."""
    b, t, h, d = (6, 64, 8, 32) if case.endswith("causal-chunks") else (3, 8, 2, 8)
    dtype = {"float32": np.float32, "bfloat16": bfloat16, "float16": np.float16}.get(case.split("-")[0], np.float64)
    rng = np.random.default_rng(3)
    qkv, g = rng.standard_normal((b, t, 3 * d)).astype(dtype), rng.standard_normal((b, t, d)).astype(dtype)
    kw = {"is_causal": not case.endswith("mask")}
    if case.endswith("mask"):
        kw["attn_mask"] = rng.standard_normal((t, t)).astype(dtype)
    results = []
    for recompute in (False, True):
        if case.endswith("dropout"):
            kw.update(dropout_p=0.3, generator=np.random.default_rng(5))
        x = nn.Tensor(qkv.copy(), requires_grad=True)
        y = F.multi_head_attention(x, h, recompute_probs=recompute, **kw)
        y.backward(g)
        results.append((y.data, x.grad))
    np.testing.assert_array_equal(results[1][0], results[0][0])
    np.testing.assert_array_equal(results[1][1], results[0][1])


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["nodrop", "dropout"])
def test_multi_head_attention_recompute_probs_matches_finite_differences(dropout):
    rng = np.random.default_rng(4)
    qkv = rng.standard_normal((2, 5, 12))
    gen = np.random.default_rng(9)
    start = gen.bit_generator.state

    def reset():   # every forward draws the same dropout mask
        gen.bit_generator.state = start

    gradcheck(lambda x: F.multi_head_attention(x, 2, is_causal=True, dropout_p=dropout, generator=gen,
                                               recompute_probs=True), qkv, reset=reset)


def test_selective_gpt_gradient_matches_central_finite_differences():
    """The loss's derivative along a random direction of all parameters: sum(grad . v) against
    (L(theta + eps v) - L(theta - eps v)) / 2 eps, with dropout (the same masks in every forward)."""
    model = tiny(0.1, mode="selective")
    x = np.random.default_rng(1).integers(0, 37, (2, 8))
    params = list(model.parameters())
    rng = np.random.default_rng(2)
    direction = [rng.standard_normal(p.data.shape) for p in params]
    norm = np.sqrt(sum(float(np.sum(v * v)) for v in direction))
    direction = [v / norm for v in direction]   # a unit step: eps is the step's length

    def loss_value():
        mpidist.manual_seed(3)
        with nn.no_grad():
            return float(lm_loss(model(x), x))

    mpidist.manual_seed(3)
    lm_loss(model(x), x).backward()
    analytic = sum(float(np.sum(p.grad * v)) for p, v in zip(params, direction))
    eps, values = 1e-5, []
    for sign in (1, -1):
        for p, v in zip(params, direction):
            p.data += sign * eps * v
        values.append(loss_value())
        for p, v in zip(params, direction):
            p.data -= sign * eps * v
    numeric = (values[0] - values[1]) / (2 * eps)
    assert abs(analytic) > 1e-2
    np.testing.assert_allclose(analytic, numeric, rtol=1e-7)


def test_checkpoint_blocks_modes_switch_and_a_bad_mode_raises():
    model = tiny()
    attn = [b.attn for b in model.blocks]
    assert model.checkpoint_blocks(mode="selective") is model
    assert all(a.recompute_probs for a in attn) and not any(b.activation_checkpointing for b in model.blocks)
    model.checkpoint_blocks()   # full replaces selective: the block's own recompute holds no probabilities
    assert not any(a.recompute_probs for a in attn) and all(b.activation_checkpointing for b in model.blocks)
    model.checkpoint_blocks(False, mode="selective")
    assert not any(a.recompute_probs for a in attn) and not any(b.activation_checkpointing for b in model.blocks)
    with pytest.raises(ValueError, match=r"GPT.checkpoint_blocks: mode must be 'full' or 'selective' \(got 'some'\)"):
        model.checkpoint_blocks(mode="some")


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "pipeline"])
def test_selective_recompute_trains_like_one_process(comm, wrapper):
    """Per block, so it composes with every wrapper: parity with one process that keeps everything, and each
    block's forward runs once (no whole-block recompute)."""
    state, losses, norms = reference(batch=8)
    model = make_gpt().checkpoint_blocks(mode="selective")
    counts = count_block_forwards(model)
    if wrapper == "pipeline":
        p, r = comm.Get_size(), comm.Get_rank()
        stages = model.pipeline_stages(p)
        history = pipeline_train(comm, [stages[r]], "1f1b", 2)
        assert_stages_match([stages[r]], [reference_model(state).pipeline_stages(p)[r]])
        held = [i for i, b in enumerate(model.blocks) if any(b is layer for layer in stages[r])]
        assert [counts[i] for i in held] == [2 * STEPS] * len(held)
    else:
        wrapped = DDP(model, comm) if wrapper == "ddp" else FSDP(model, comm, units=model.fsdp_units())
        history = data_parallel_train(comm, wrapped, 8, model)
        assert_state_matches(full_state(comm, wrapped, model), state)
        assert counts == [STEPS] * 2
    assert_history_matches(*history, losses, norms)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("sequence_parallel,before", [(False, True), (True, False)],
                         ids=["tp-set-before-split", "sp-set-after-split"])
def test_selective_recompute_under_tensor_parallelism_matches_one_process(comm, sequence_parallel, before):
    """One step's gradient slices equal one process's (which keeps everything); each rank's graph holds its heads'
    probabilities fewer: batch x heads / tp x seq^2 x 8 bytes per block."""
    x, y = global_batch(0)
    ref = make_gpt()
    lm_loss(ref(x), y).backward()
    expected = {n: p.grad for n, p in ref.named_parameters()}
    held = {}
    for mode in (None, "selective"):
        model = make_gpt()
        if mode and before:
            model.checkpoint_blocks(mode=mode)
        tensor_parallel(model, comm, sequence_parallel=sequence_parallel)
        if mode and not before:
            model.checkpoint_blocks(mode=mode)
        assert all(b.attn.recompute_probs == (mode is not None) for b in model.blocks)
        loss = model.loss(model(x), y)
        held[mode] = saved_bytes(loss)
        loss.backward()
    for name, p in model.named_parameters():
        assert_slice_matches(p.grad, placement_of(p), expected[name], name)
    c, tp = model.config, comm.Get_size()
    assert held[None] - held["selective"] == c.n_layer * len(x) * (c.n_head // tp) * c.block_size ** 2 * 8
