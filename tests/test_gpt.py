"""The GPT model (mpidist.models.gpt) on its own, and trained by every strategy against one process.

Model tests check the GPT against independent references: gradients against central finite differences,
the parameter count against a sum over layer shapes, ``flops_per_token`` against the matmuls a forward
really runs (counted from their operand shapes), greedy ``generate`` against argmax decoding written out
with full forwards.

Parity tests train a tiny GPT (width 32, 4 heads, context 16, float64, no dropout; 2 layers, 3-4 where a
split needs more) for a few AdamW steps with ``clip_grad_norm_`` at a max_norm small enough that it clips
every step, and compare every parameter, loss and gradient norm with the same model trained in one process
on the same global batches: DDP, FSDP (each strategy, one unit per layer, the tied weight shared between
the embedding and head units), activation checkpointing, gradient accumulation, every pipeline schedule at
p = 1..4 with even and uneven layer counts and the tied embedding/head copies, and a dp x pp mesh. Each runs
on SimComm worlds and under ``mpiexec -n 2 / -n 4 pytest --with-mpi``.
"""
import contextlib
import functools
import math
import threading

import numpy as np
import pytest

from gradcheck import numeric_grad
from mpidist import nn
from mpidist.models import GPT, GPTConfig, lm_loss
from mpidist.models.gpt import split_layers
from mpidist.nn import functional as F
from mpidist.optim import AdamW
from mpidist.parallel.ddp import DDP
from mpidist.parallel.fsdp import FSDP
from mpidist.parallel import mesh
from mpidist.parallel.pipeline import Pipeline

TOL = 1e-10
STEPS = 3
LR = 1e-2
MAX_NORM = 0.3   # below every step's gradient norm (0.49 to 1.38 here; reference() checks): clipping always acts
VOCAB, T, D, HEADS = 256, 16, 32, 4
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb_h1"]
STRATEGIES = ["full_shard", "shard_grad_op", "no_shard"]


def config(n_layer=2, **kw):
    return GPTConfig(**dict(dict(vocab_size=VOCAB, block_size=T, n_layer=n_layer, n_head=HEADS, n_embd=D,
                                 dropout=0.0, dtype="float64"), **kw))


def make_model(n_layer=2, **kw):
    """The same initial weights on every rank and in the reference: one seeded generator builds the model."""
    return GPT(config(n_layer, **kw), rng=np.random.default_rng(0))


def global_batch(step, n):
    """Step ``step``'s global batch of ``n`` sequences (token ids, next-token targets), equal on every rank."""
    rng = np.random.default_rng(1000 + step)
    tokens = rng.integers(0, VOCAB, (n, T + 1))
    return tokens[:, :-1], tokens[:, 1:]


def rows(a, part, parts):
    """Part ``part`` of ``parts`` equal slices of a batch along its first axis."""
    n = len(a) // parts
    assert n * parts == len(a), f"batch of {len(a)} does not split into {parts} equal parts"
    return a[part * n:(part + 1) * n]


_reference_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def _reference(n_layer, batch):
    model = make_model(n_layer)
    opt = AdamW(list(model.parameters()), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = global_batch(step, batch)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        norms.append(float(nn.clip_grad_norm_(model.parameters(), MAX_NORM)))
        losses.append(float(loss))
        opt.step()
    state = model.state_dict()
    for a in state.values():
        a.setflags(write=False)
    return state, losses, norms


def reference(n_layer=2, batch=8):
    """(state_dict, losses, gradient norms before clipping) of single-process training on the global batches."""
    with _reference_lock:  # simulated ranks are threads: compute once, share the read-only result
        state, losses, norms = _reference(n_layer, batch)
    assert min(norms) > MAX_NORM, f"clipping must be active in every step (norms {norms})"
    return state, losses, norms


def assert_state_matches(state, expected):
    assert list(state) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=TOL, atol=TOL, err_msg=name)


def assert_history_matches(losses, norms, ref_losses, ref_norms):
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL, atol=0, err_msg="losses")
    np.testing.assert_allclose(norms, ref_norms, rtol=TOL, atol=0, err_msg="gradient norms before clipping")


def data_parallel_train(comm, wrapper, batch, model, microsteps=1):
    """Train ``wrapper`` (DDP or FSDP of ``model``) on this rank's slice of each global batch; return the history.

    With ``microsteps`` > 1 the slice is split and all but the last backward run under ``no_sync()``."""
    opt = AdamW(list(wrapper.parameters()), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (rows(a, comm.Get_rank(), comm.Get_size()) for a in global_batch(step, batch))
        opt.zero_grad()
        total = 0.0
        for k in range(microsteps):
            last = k == microsteps - 1
            with contextlib.nullcontext() if last else wrapper.no_sync():
                loss = lm_loss(wrapper(rows(x, k, microsteps)), rows(y, k, microsteps)) * (1.0 / microsteps)
                loss.backward()
            total += float(loss)
        norms.append(float(wrapper.clip_grad_norm_(MAX_NORM)))
        losses.append(float(np.mean(comm.allgather(total))))  # equal slices: the mean of means
        opt.step()
    return losses, norms


def full_state(comm, wrapper, model):
    """The whole model's parameters on every rank: FSDP gathers them, DDP holds them."""
    if isinstance(wrapper, FSDP):
        return comm.bcast(wrapper.full_state_dict(), root=0)
    return model.state_dict()


def count_block_forwards(model):
    """Count each block's attention forwards (a checkpointed block runs it again in backward)."""
    counts = [0] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        def hook(module, args, out, i=i):
            counts[i] += 1
        block.attn.register_forward_hook(hook)
    return counts


# -- the model on its own ---------------------------------------------------------------------------------
def expected_num_parameters(c, untied_head=False, bias=True):
    """Parameters from the layer shapes: wte V*d, wpe T*d, per block two norms (2d each) and four linears
    (qkv d->3d, proj d->d, fc d->r*d, proj r*d->d, each with its biases), the final norm, an untied head V*d."""
    d, r = c.n_embd, c.mlp_ratio
    linears = [(d, 3 * d), (d, d), (d, r * d), (r * d, d)]
    block = 2 * (d + (d if bias else 0)) + sum(i * o + (o if bias else 0) for i, o in linears)
    return (c.vocab_size * d + c.block_size * d + c.n_layer * block + d + (d if bias else 0)
            + (c.vocab_size * d if untied_head else 0))


def few_entries(name, shape, rng, used_rows):
    """Flat indices of three entries of a parameter; embedding rows among those the batch looks up."""
    if name in used_rows:
        r = rng.choice(used_rows[name], 3, replace=False)
        return [int(np.ravel_multi_index((i, rng.integers(shape[1])), shape)) for i in r]
    return [int(i) for i in rng.choice(int(np.prod(shape)), min(3, int(np.prod(shape))), replace=False)]


@pytest.mark.parametrize("tie", [True, False])
def test_gradients_match_finite_differences(tie):
    model = make_model(tie_weights=tie)
    rng = np.random.default_rng(5)
    x, y = global_batch(0, 2)
    x, y = x[:, :9], y[:, :9]
    unused = np.setdiff1d(np.arange(VOCAB), x)
    model.zero_grad()
    lm_loss(model(x), y).backward()

    def loss():
        with nn.no_grad():
            return float(lm_loss(model(x), y))

    # Rows the forward reads: tokens of x (and, tied, also rows it does not: the head reads every row),
    # the first 9 positions.
    used_rows = {"embed.wte.weight": np.unique(x) if not tie else np.concatenate([np.unique(x)[:2], unused[:1]]),
                 "embed.wpe.weight": np.arange(9)}
    names = [n for n, _ in model.named_parameters()]
    assert ("head.weight" in names) == (not tie)
    for name, p in model.named_parameters():
        flat_data, flat_grad = p.data.reshape(-1), p.grad.reshape(-1)
        assert np.shares_memory(flat_data, p.data)
        for i in few_entries(name, p.data.shape, rng, used_rows):
            fd = numeric_grad(loss, flat_data[i:i + 1], eps=1e-5)[0]
            np.testing.assert_allclose(flat_grad[i], fd, rtol=1e-6, atol=1e-9, err_msg=f"{name}[{i}]")
    wte = model.embed.wte.weight.grad
    if tie:  # the head's use alone: rows the batch never looks up still get a gradient
        assert (np.abs(wte[unused]).max(axis=1) > 0).all()
    else:
        assert not wte[unused].any()
        assert np.abs(model.head.weight.grad).sum() > 0


def test_tied_and_untied_heads():
    tied, untied = make_model(), make_model(tie_weights=False)
    assert tied.head.weight is tied.embed.wte.weight
    assert untied.head.weight is not untied.embed.wte.weight
    assert tied.num_parameters() == expected_num_parameters(tied.config)
    assert untied.num_parameters() == expected_num_parameters(untied.config, untied_head=True)
    assert untied.num_parameters() - tied.num_parameters() == VOCAB * D
    assert tied.num_parameters(non_embedding=True) == tied.num_parameters() - T * D
    assert "head.weight" not in tied.state_dict() and "head.weight" in untied.state_dict()
    # One step: embedding rows the batch does not look up get a gradient only through a tied head, so only
    # there does Adam move them (an untied one just decays by lr * weight_decay, ~2e-6).
    x, y = global_batch(0, 2)
    unused = np.setdiff1d(np.arange(VOCAB), x)
    moved = {}
    for model in (tied, untied):
        before = model.embed.wte.weight.data.copy()
        opt = AdamW(list(model.parameters()), lr=LR)
        lm_loss(model(x), y).backward()
        opt.step()
        moved[model is tied] = np.abs(model.embed.wte.weight.data - before)[unused].max(axis=1)
    assert tied.head.weight.data is tied.embed.wte.weight.data
    assert moved[True].min() > 1e-3 and moved[False].max() < 1e-5


def test_bias_false_means_no_biases_anywhere():
    model = make_model(bias=False)
    assert not [n for n, _ in model.named_parameters() if n.endswith(".bias")]
    assert model.num_parameters() == expected_num_parameters(model.config, bias=False)
    x, y = global_batch(0, 2)
    lm_loss(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gpt2_initialisation():
    n_layer = 4
    model = GPT(config(n_layer, n_embd=64, block_size=64), rng=np.random.default_rng(3))
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * n_layer)

    def pooled(arrays):
        return np.concatenate([a.ravel() for a in arrays])

    blocks = list(model.blocks)
    groups = {"residual projections": (pooled([b.attn.proj.weight.data for b in blocks]
                                              + [b.mlp.proj.weight.data for b in blocks]), resid_std),
              "qkv and fc": (pooled([b.attn.qkv.weight.data for b in blocks] + [b.mlp.fc.weight.data for b in blocks]),
                             std),
              "embeddings": (pooled([model.embed.wte.weight.data, model.embed.wpe.weight.data]), std)}
    for what, (values, expected) in groups.items():
        # >= 16k samples each: the sample std is within 2% of the true one with overwhelming probability.
        assert values.size >= 16000
        assert abs(values.std() / expected - 1) < 0.04, (what, values.std(), expected)
        assert abs(values.mean()) < 0.05 * expected, what
    for b in blocks:  # every layer's own residual projections are scaled, not just the pool
        for w in (b.attn.proj.weight.data, b.mlp.proj.weight.data):
            assert abs(w.std() / resid_std - 1) < 0.15
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert not p.data.any(), name
        if ".ln" in name and name.endswith(".weight"):
            assert (p.data == 1).all(), name
    assert all(p.data.dtype == np.float64 for p in model.parameters())
    # One generator fixes the whole model; another gives other weights.
    same = GPT(config(n_layer, n_embd=64, block_size=64), rng=np.random.default_rng(3))
    other = GPT(config(n_layer, n_embd=64, block_size=64), rng=np.random.default_rng(4))
    for (name, a), b, c in zip(model.named_parameters(), same.parameters(), other.parameters()):
        np.testing.assert_array_equal(a.data, b.data, err_msg=name)
        if not (name.endswith(".bias") or ".ln" in name):
            assert not np.array_equal(a.data, c.data), name


@pytest.mark.parametrize("n_layer, mlp_ratio, vocab, tie, seq_len, llama",
                         [(2, 4, 256, True, None, False), (2, 4, 256, True, 8, False), (3, 2, 50, False, 5, False),
                          (2, 4, 50, False, 6, True)])
def test_flops_per_token_counts_the_matmuls_of_a_forward(monkeypatch, n_layer, mlp_ratio, vocab, tie, seq_len,
                                                         llama):
    # llama: SwiGLU of 40 units (its fused gate and up: one product of 2 x 40 outputs), RMSNorm, 2 k/v heads
    extra = dict(mlp="swiglu", ffn_hidden=40, norm="rmsnorm", positions="rope", bias=False, n_kv_head=2) if llama else {}
    model = GPT(config(n_layer, mlp_ratio=mlp_ratio, vocab_size=vocab, tie_weights=tie, **extra),
                rng=np.random.default_rng(0))
    flops = [0]
    linear, attention = F.linear, F.scaled_dot_product_attention

    def counting_linear(x, weight, bias=None):
        out_features, in_features = weight.shape
        flops[0] += 2 * int(np.prod(x.shape[:-1])) * in_features * out_features
        return linear(x, weight, bias)

    def counting_attention(q, k, v, *args, **kwargs):
        *lead, tq, hd = q.shape
        tk = k.shape[-2]
        flops[0] += 2 * int(np.prod(lead)) * tq * tk * hd + 2 * int(np.prod(lead)) * tq * tk * v.shape[-1]
        return attention(q, k, v, *args, **kwargs)

    def counting_multi_head_attention(qkv, num_heads, *args, **kwargs):  # packed (batch, t, 3 * d): all heads
        *lead, t, three_d = qkv.shape
        flops[0] += 2 * 2 * int(np.prod(lead)) * t * t * (three_d // 3)
        return multi_head_attention(qkv, num_heads, *args, **kwargs)

    multi_head_attention = F.multi_head_attention
    monkeypatch.setattr(F, "linear", counting_linear)
    monkeypatch.setattr(F, "scaled_dot_product_attention", counting_attention)
    monkeypatch.setattr(F, "multi_head_attention", counting_multi_head_attention)
    t = T if seq_len is None else seq_len
    batch = 3
    with nn.no_grad():
        model(np.zeros((batch, t), dtype=np.int64))
    assert flops[0] > 0
    # Training = forward + backward = 3x the forward's matmul FLOPs.
    assert model.flops_per_token(seq_len) == 3 * flops[0] // (batch * t)
    assert 3 * flops[0] % (batch * t) == 0


def greedy_by_hand(model, idx, n):
    """Argmax decoding with a full forward of the last block_size tokens per new token."""
    out = np.array(idx, dtype=np.int64)
    with nn.no_grad():
        for _ in range(n):
            logits = model(out[:, -model.config.block_size:]).data[:, -1, :]
            out = np.concatenate([out, logits.argmax(axis=-1)[:, None]], axis=1)
    return out


def test_generate_shape_and_determinism():
    model = make_model()
    prompt = global_batch(0, 2)[0][:, :5]
    out = model.generate(prompt, 7, rng=np.random.default_rng(1))
    assert out.shape == (2, 12) and out.dtype == np.int64
    np.testing.assert_array_equal(out[:, :5], prompt)
    assert out.min() >= 0 and out.max() < VOCAB
    np.testing.assert_array_equal(out, model.generate(prompt, 7, rng=np.random.default_rng(1)))
    # Near-uniform logits of a fresh model: another seed samples other tokens.
    assert not np.array_equal(out, model.generate(prompt, 7, rng=np.random.default_rng(2)))
    one = model.generate(prompt[0], 3, rng=np.random.default_rng(1))
    assert one.shape == (1, 8)
    assert model.generate(prompt, 0).shape == (2, 5)
    assert model.training, "generate must give back the training mode it found"
    model.eval()
    model.generate(prompt, 1, temperature=0)
    assert not model.training


@pytest.mark.parametrize("prompt_len", [3, T + 5])  # T + 5: every step crops to the last block_size tokens
def test_greedy_generate_equals_argmax_decoding(prompt_len):
    model = make_model()
    # Sharper logits than a fresh model's, so greedy decoding is not decided by rounding.
    for p in model.parameters():
        p.data *= 3
    prompt = np.random.default_rng(7).integers(0, VOCAB, (2, prompt_len))
    expected = greedy_by_hand(model, prompt, 6)
    assert len(set(expected[:, prompt_len:].ravel())) > 1
    np.testing.assert_array_equal(model.generate(prompt, 6, temperature=0), expected)
    np.testing.assert_array_equal(model.generate(prompt, 6, top_k=1, rng=np.random.default_rng(3)), expected)
    if prompt_len > T:
        with pytest.raises(ValueError, match=f"{prompt_len} tokens is longer than block_size {T}"):
            model(prompt)


def test_top_k_samples_only_among_the_k_most_likely():
    model = make_model()
    prompt = np.random.default_rng(8).integers(0, VOCAB, (4, 4))
    k = 3
    out = model.generate(prompt, 5, top_k=k, temperature=2.0, rng=np.random.default_rng(0))
    with nn.no_grad():
        for j in range(4, out.shape[1]):
            logits = model(out[:, :j]).data[:, -1, :]
            top = np.argsort(logits, axis=-1)[:, -k:]
            assert all(out[b, j] in top[b] for b in range(len(out)))
    assert len(set(out[:, 4:].ravel())) > 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(n=-1), r"n must be an int >= 0 \(got -1\)"),
    (dict(n=2.0), r"n must be an int >= 0 \(got 2.0\)"),
    (dict(n=1, temperature=-0.5), r"temperature must be >= 0 \(got -0.5\)"),
    (dict(n=1, top_k=0), r"top_k must be None or an int >= 1 \(got 0\)"),
])
def test_generate_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_model().generate(np.zeros((1, 2), dtype=np.int64), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_layer=0), r"n_layer must be an int >= 1 \(got 0\)"),
    (dict(vocab_size=2.5), r"vocab_size must be an int >= 1 \(got 2.5\)"),
    (dict(n_head=True), r"n_head must be an int >= 1 \(got True\)"),
    (dict(block_size=-3), r"block_size must be an int >= 1 \(got -3\)"),
    (dict(n_embd=30), r"n_embd 30 is not divisible by n_head 4"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\) \(got 1.0\)"),
    (dict(dtype="int32"), r"dtype must be a floating-point dtype name \(got 'int32'\)"),
    (dict(dtype="nonsense"), r"dtype must be a floating-point dtype name \(got 'nonsense'\)"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        config(**kwargs)


def test_config_errors_list_every_problem_and_model_wants_a_config():
    with pytest.raises(ValueError, match=r"n_layer must be .*got 0.*; dropout must be .*got -0.1"):
        config(n_layer=0, dropout=-0.1)
    with pytest.raises(TypeError, match="config must be a GPTConfig .got dict"):
        GPT(dict(n_layer=2))


def test_token_ids_longer_than_block_size_or_not_2d_raise():
    model = make_model()
    model(np.zeros((1, T), dtype=np.int64))  # exactly block_size is fine
    with pytest.raises(ValueError, match=f"sequence of {T + 1} tokens is longer than block_size {T}"):
        model(np.zeros((1, T + 1), dtype=np.int64))
    with pytest.raises(ValueError, match=r"\(batch, time\) integer array \(got shape \(5,\)\)"):
        model(np.zeros(5, dtype=np.int64))


@pytest.mark.parametrize("n_layer, stages, expected", [
    (4, 2, [2, 2]), (4, 1, [4]), (5, 3, [2, 2, 1]), (3, 4, [1, 1, 1, 0]), (2, 4, [0, 1, 1, 0]), (6, 4, [1, 2, 2, 1]),
])
def test_split_layers_spreads_the_remainder_over_the_middle_stages(n_layer, stages, expected):
    counts = split_layers(n_layer, stages)
    assert counts == expected
    assert sum(counts) == n_layer and max(counts) - min(counts) <= 1
    assert split_layers(n_layer, stages, list(reversed(expected))) == list(reversed(expected))


@pytest.mark.parametrize("num_stages, layers_per_stage, match", [
    (0, None, r"num_stages must be an int >= 1 \(got 0\)"),
    ("2", None, r"num_stages must be an int >= 1 \(got '2'\)"),
    (2, [1, 1, 1], r"layers_per_stage \[1, 1, 1\] must have 2 non-negative counts summing to n_layer=3"),
    (2, [1, 1], r"layers_per_stage \[1, 1\] must have 2 non-negative counts summing to n_layer=3"),
    (2, [4, -1], r"layers_per_stage \[4, -1\] must have 2 non-negative counts summing to n_layer=3"),
])
def test_split_layers_bad_inputs(num_stages, layers_per_stage, match):
    with pytest.raises(ValueError, match=match):
        split_layers(3, num_stages, layers_per_stage)
    with pytest.raises(ValueError, match=match):
        make_model(3).pipeline_stages(num_stages, layers_per_stage)


def test_pipeline_stages_cut_the_model_in_order():
    model = make_model(3)
    stages = model.pipeline_stages(3, [0, 2, 1])
    assert [len(s) for s in stages] == [1, 2, 2]
    assert stages[0][0] is model.embed and stages[2][1] is not model.head
    assert [s.first_layer for s in stages] == [0, 1, 3]
    # Each layer under its name in the unsplit model: the stages' parameters, renamed so, are the model's.
    assert [s.names for s in stages] == [("embed",), ("blocks.0", "blocks.1"), ("blocks.2", "head")]
    assert [s[:1].names for s in stages[1:]] == [("blocks.0",), ("blocks.2",)]
    named = dict(model.named_parameters())
    for s in stages:
        for name, layer in zip(s.names, s):
            for pname, p in layer.named_parameters():
                if f"{name}.{pname}" != "head.weight":  # the tied copy: the model has it once, as embed.wte.weight
                    assert named[f"{name}.{pname}"] is p, f"{name}.{pname}"
    assert [list(s) for s in stages[1:2]] == [[model.blocks[0], model.blocks[1]]]
    assert stages[2][0] is model.blocks[2] and stages[2][1].ln_f is model.head.ln_f
    # The tied copies: the embedding's own weight and a separate copy of its values for the head.
    first, last = stages[0].tied, stages[2].tied
    assert len(first) == len(last) == 1 and first[0] is model.embed.wte.weight
    assert last[0] is stages[2][1].weight and last[0] is not first[0]
    np.testing.assert_array_equal(last[0].data, first[0].data)
    assert not np.shares_memory(last[0].data, first[0].data)
    assert stages[1].tied == []
    # Chained, the stages are the model.
    x = global_batch(0, 2)[0]
    with nn.no_grad():
        np.testing.assert_array_equal(nn.Sequential(*stages)(x).data, model(x).data)
    single = model.pipeline_stages(1)[0]
    assert single.tied == [] and single[len(single) - 1] is model.head
    untied = make_model(3, tie_weights=False).pipeline_stages(2)
    assert untied[0].tied == [] and untied[1].tied == []


def test_checkpointed_blocks_recompute_and_give_the_same_gradients():
    x, y = global_batch(0, 4)
    grads = {}
    for checkpointed in (False, True):
        model = make_model()
        if checkpointed:
            assert model.checkpoint_blocks() is model
        counts = count_block_forwards(model)
        lm_loss(model(x), y).backward()
        assert counts == [2 if checkpointed else 1] * 2
        grads[checkpointed] = {n: p.grad.copy() for n, p in model.named_parameters()}
    for name, g in grads[False].items():
        np.testing.assert_allclose(grads[True][name], g, rtol=0, atol=1e-14, err_msg=name)
    model = make_model().checkpoint_blocks().checkpoint_blocks(False)
    counts = count_block_forwards(model)
    lm_loss(model(x), y).backward()
    assert counts == [1, 1]


# -- data parallel ------------------------------------------------------------------------------------------
def test_ddp_matches_single_process(comm):
    state, losses, norms = reference(batch=12)
    model = make_model()
    ddp = DDP(model, comm)
    history = data_parallel_train(comm, ddp, 12, model)
    assert_history_matches(*history, losses, norms)
    assert_state_matches(model.state_dict(), state)


@pytest.mark.world_sizes(2, 3, 4)  # 3: no unit's size divides, so every shard is padded
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp_matches_single_process(comm, strategy):
    state, losses, norms = reference(batch=12)
    model = make_model()
    units = model.fsdp_units()
    assert units[0] is model.embed and units[-1] is model.head and len(units) == 4
    fsdp = FSDP(model, comm, strategy=strategy, units=units)
    history = data_parallel_train(comm, fsdp, 12, model)
    assert_history_matches(*history, losses, norms)
    assert_state_matches(full_state(comm, fsdp, model), state)
    with fsdp.summon_full_params() as module:
        assert module.head.weight is module.embed.wte.weight
        np.testing.assert_allclose(module.head.weight.data, state["embed.wte.weight"], rtol=TOL, atol=TOL)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_gradient_accumulation_with_no_sync_equals_one_big_batch(comm, wrapper):
    state, losses, norms = reference(batch=8)  # 8 / ranks (2, 4) splits into 2 micro-batches
    model = make_model()
    wrapped = DDP(model, comm) if wrapper == "ddp" else FSDP(model, comm, units=model.fsdp_units())
    history = data_parallel_train(comm, wrapped, 8, model, microsteps=2)
    assert_history_matches(*history, losses, norms)
    assert_state_matches(full_state(comm, wrapped, model), state)


@pytest.mark.world_sizes(2, 4)
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "pipeline"])
def test_checkpointed_blocks_train_like_single_process(comm, wrapper):
    state, losses, norms = reference(batch=8)
    model = make_model().checkpoint_blocks()
    counts = count_block_forwards(model)
    if wrapper == "pipeline":
        p, r = comm.Get_size(), comm.Get_rank()
        stages = model.pipeline_stages(p)
        m = 2
        history = pipeline_train(comm, [stages[r]], "1f1b", m)
        ref_stages = reference_model(state).pipeline_stages(p)
        assert_stages_match([stages[r]], [ref_stages[r]])
        held = [i for i, b in enumerate(model.blocks) if any(b is layer for layer in stages[r])]
        assert [counts[i] for i in held] == [2 * m * STEPS] * len(held)
    else:
        wrapped = DDP(model, comm) if wrapper == "ddp" else FSDP(model, comm, units=model.fsdp_units())
        history = data_parallel_train(comm, wrapped, 8, model)
        assert_state_matches(full_state(comm, wrapped, model), state)
        assert counts == [2 * STEPS] * 2, "every block's forward runs again in backward"
    assert_history_matches(*history, losses, norms)


# -- pipelines ----------------------------------------------------------------------------------------------
def reference_model(state):
    model = make_model(max(int(k.split(".")[1]) for k in state if k.startswith("blocks.")) + 1)
    model.load_state_dict(dict(state))
    return model


def pipeline_train(comm, chunks, schedule, m, batch=8, replica=0, replicas=1, tied=True, dp_comm=None):
    """Train this rank's stage modules ``chunks`` with a Pipeline over ``comm``; return (losses, norms)."""
    pipe = Pipeline(chunks if schedule == "interleaved" else chunks[0], comm, m, schedule, loss_fn=lm_loss,
                    dp_comm=dp_comm, tied_parameters=[t for c in chunks for t in c.tied] if tied else None)
    params = list(pipe.parameters())
    opt = AdamW(params, lr=LR) if params else None  # a stage of no blocks (identity) has nothing to step
    losses, norms = [], []
    for step in range(STEPS):
        x, y = (rows(a, replica, replicas) for a in global_batch(step, batch))
        for c in chunks:
            c.zero_grad()
        losses.append(pipe.step(x, y, broadcast_loss=True))
        norms.append(pipe.clip_grad_norm_(MAX_NORM))
        if opt is not None:
            opt.step()
    for group in pipe.tied:
        group.free()
    return losses, norms


def assert_stages_match(chunks, ref_chunks):
    for chunk, ref in zip(chunks, ref_chunks, strict=True):
        mine, theirs = list(chunk.named_parameters()), list(ref.named_parameters())
        assert [n for n, _ in mine] == [n for n, _ in theirs]
        for (name, a), (_, b) in zip(mine, theirs):
            np.testing.assert_allclose(a.data, b.data, rtol=TOL, atol=TOL, err_msg=name)


def my_chunks(stages, p, r):
    return [stages[c * p + r] for c in range(len(stages) // p)]


@pytest.mark.world_sizes(1, 2, 3, 4)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_matches_single_process(comm, schedule):
    p, r = comm.Get_size(), comm.Get_rank()
    num_stages = p * (2 if schedule == "interleaved" else 1)
    n_layer = 2 if num_stages <= 3 else 4  # 8 stages of 4 layers: two stages hold nothing (identity)
    state, losses, norms = reference(n_layer, batch=8)
    model = make_model(n_layer)
    chunks = my_chunks(model.pipeline_stages(num_stages), p, r)
    history = pipeline_train(comm, chunks, schedule, m=3)  # micro-batches of 3, 3 and 2 sequences
    assert_history_matches(*history, losses, norms)
    assert_stages_match(chunks, my_chunks(reference_model(state).pipeline_stages(num_stages), p, r))


UNEVEN = {2: (3, [2, 1]), 3: (3, [0, 2, 1]), 4: (4, [1, 2, 0, 1])}  # n_layer, blocks per stage


@pytest.mark.world_sizes(2, 3, 4)
@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipeline_with_uneven_layer_counts_matches_single_process(comm, schedule):
    p, r = comm.Get_size(), comm.Get_rank()
    n_layer, counts = UNEVEN[p]
    state, losses, norms = reference(n_layer, batch=8)
    model = make_model(n_layer)
    stages = model.pipeline_stages(p, counts)
    blocks = [sum(1 for layer in s if layer in list(model.blocks)) for s in stages]
    assert blocks == counts
    history = pipeline_train(comm, [stages[r]], schedule, m=4)
    assert_history_matches(*history, losses, norms)
    assert_stages_match([stages[r]], [reference_model(state).pipeline_stages(p, counts)[r]])


def tied_copies(comm, stages, r):
    """The first stage's embedding weight and the last stage's head copy, gathered to every rank."""
    p = comm.Get_size()
    mine = {0: stages[0].tied, p - 1: stages[-1].tied}.get(r, [])
    gathered = comm.allgather([t.data.copy() for t in mine] if r in (0, p - 1) else None)
    return gathered[0][0], gathered[p - 1][-1]


@pytest.mark.world_sizes(2, 3, 4)
def test_tied_copies_stay_equal_only_with_tied_parameters(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    state, losses, norms = reference(2, batch=8)
    for tied in (True, False):
        model = make_model(2)
        stages = model.pipeline_stages(p)
        history = pipeline_train(comm, [stages[r]], "1f1b", m=2, tied=tied)
        embedding, head = tied_copies(comm, stages, r)
        if tied:
            np.testing.assert_array_equal(embedding, head)
            np.testing.assert_allclose(embedding, state["embed.wte.weight"], rtol=TOL, atol=TOL)
            assert_history_matches(*history, losses, norms)
        else:  # each copy follows its own use's gradient alone: they part, and both leave the reference
            assert np.abs(embedding - head).max() > 1e-3
            assert np.abs(embedding - state["embed.wte.weight"]).max() > 1e-3
            assert np.abs(head - state["embed.wte.weight"]).max() > 1e-3


@pytest.mark.world_sizes(2, 4)
def test_pipeline_clip_counts_the_tied_weight_once(comm):
    p, r = comm.Get_size(), comm.Get_rank()
    x, y = global_batch(0, 8)
    ref = make_model(2)
    lm_loss(ref(x), y).backward()
    wte_grad = ref.embed.wte.weight.grad.copy()
    ref_norm = float(nn.clip_grad_norm_(ref.parameters(), MAX_NORM))
    twice = math.sqrt(ref_norm ** 2 + float(np.sum(wte_grad ** 2)))
    assert twice > ref_norm * 1.01, "premise: counting the tied weight twice changes the norm"
    stages = make_model(2).pipeline_stages(p)
    pipe = Pipeline(stages[r], comm, 2, "1f1b", loss_fn=lm_loss, tied_parameters=stages[r].tied)
    pipe.step(x, y)
    norm = pipe.clip_grad_norm_(MAX_NORM)
    assert norm == pytest.approx(ref_norm, rel=TOL)
    # Both copies hold the clipped gradient of the one shared weight.
    for t in stages[r].tied:
        np.testing.assert_allclose(t.grad, ref.embed.wte.weight.grad, rtol=TOL, atol=TOL)
    for group in pipe.tied:
        group.free()


@pytest.mark.world_sizes(4)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_dp_x_pp_mesh_matches_single_process(comm, schedule):
    grid = mesh(comm, dp=2, pp=2)
    num_stages = 2 * (2 if schedule == "interleaved" else 1)
    n_layer = 2 if num_stages == 2 else 4
    state, losses, norms = reference(n_layer, batch=8)
    model = make_model(n_layer)
    chunks = my_chunks(model.pipeline_stages(num_stages), 2, grid.pp_rank)
    history = pipeline_train(grid.pp_comm, chunks, schedule, m=2, replica=grid.dp_rank, replicas=2,
                             dp_comm=grid.dp_comm)
    assert_history_matches(*history, losses, norms)
    assert_stages_match(chunks, my_chunks(reference_model(state).pipeline_stages(num_stages), 2, grid.pp_rank))
    grid.free()
