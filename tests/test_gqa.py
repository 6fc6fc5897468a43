"""Grouped-query attention (``GPTConfig.n_kv_head``, ``nn.MultiheadAttention(num_kv_heads=)``, ``F.repeat_kv``)
against independent references: a numpy per-head attention in which q head i reads k/v head i // group, central
finite differences, and a count of the weight matmuls' FLOPs; the split model against one process in
tests/test_tensor_parallel.py (``test_grouped_query_attention_trains_like_one_process``)."""
import numpy as np
import pytest

from mpidist import nn
from mpidist.models.gpt import GPT, GPTConfig
from mpidist.models.gpt_parallel import tensor_parallel
from mpidist.models.hf_gpt2 import to_hf_gpt2
from mpidist.nn import functional as F
from mpidist.nn.precision import bfloat16
from tests.gradcheck import gradcheck


def _reference_attention(x, w, b, heads, kv_heads, causal=True):
    """float64 numpy: q, k, v from ``x @ w.T + b`` as [q heads | k heads | v heads], q head i attending with
    k/v head i // (heads / kv_heads); the heads side by side."""
    bsz, t, d = x.shape
    hd = d // heads
    qkv = x @ w.T + b
    q = qkv[..., :d].reshape(bsz, t, heads, hd)
    k = qkv[..., d:d + kv_heads * hd].reshape(bsz, t, kv_heads, hd)
    v = qkv[..., d + kv_heads * hd:].reshape(bsz, t, kv_heads, hd)
    out = np.empty((bsz, t, heads, hd))
    group = heads // kv_heads
    for i in range(heads):
        scores = np.einsum("btd,bsd->bts", q[:, :, i], k[:, :, i // group]) / np.sqrt(hd)
        if causal:
            scores = scores + np.triu(np.full((t, t), -np.inf), 1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, i] = np.einsum("bts,bsd->btd", p, v[:, :, i // group])
    return out.reshape(bsz, t, d)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 1), (6, 3)])
def test_grouped_query_attention_equals_per_head_reference(heads, kv_heads):
    rng = np.random.default_rng(0)
    d = 2 * heads
    attn = nn.MultiheadAttention(d, heads, causal=True, rng=rng, dtype=np.float64, num_kv_heads=kv_heads)
    assert attn.qkv.weight.data.shape == (d + 2 * kv_heads * 2, d)
    x = rng.standard_normal((2, 5, d))
    y = attn(nn.Tensor(x)).data
    w, b = attn.qkv.weight.data, attn.qkv.bias.data
    expected = _reference_attention(x, w, b, heads, kv_heads) @ attn.proj.weight.data.T + attn.proj.bias.data
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-13)


def test_grouped_query_attention_gradients_are_central_differences():
    rng = np.random.default_rng(1)
    attn = nn.MultiheadAttention(8, 4, causal=True, rng=rng, dtype=np.float64, num_kv_heads=2)
    gradcheck(lambda x: attn(x), rng.standard_normal((2, 4, 8)), module=attn)
    attn.recompute_probs = True   # selective recompute: the same gradients from recomputed probabilities
    gradcheck(lambda x: attn(x), rng.standard_normal((2, 4, 8)), module=attn)


def test_repeat_kv_repeats_each_kv_head_for_its_group_and_sums_its_gradients():
    rng = np.random.default_rng(2)
    b, t, h, kv, hd = 2, 3, 6, 2, 4
    x = rng.standard_normal((b, t, (h + 2 * kv) * hd))
    out = F.repeat_kv(nn.Tensor(x), h, kv).data.reshape(b, t, 3, h, hd)
    parts = x.reshape(b, t, h + 2 * kv, hd)
    np.testing.assert_array_equal(out[:, :, 0], parts[:, :, :h])
    for i in range(h):
        np.testing.assert_array_equal(out[:, :, 1, i], parts[:, :, h + i // 3])
        np.testing.assert_array_equal(out[:, :, 2, i], parts[:, :, h + kv + i // 3])
    gradcheck(lambda a: F.repeat_kv(a, h, kv), x)
    # 16-bit: each group's gradients summed in float32 and rounded once
    g = rng.standard_normal((b, t, 3 * h * hd)).astype(bfloat16)
    xb = nn.Tensor(x.astype(bfloat16), requires_grad=True)
    F.repeat_kv(xb, h, kv).backward(nn.Tensor(g))
    grouped = g.astype(np.float64).reshape(b, t, 3, kv, 3, hd)[:, :, 1:].sum(axis=4)
    expected = np.concatenate([g.reshape(b, t, 3, h, hd)[:, :, 0].astype(np.float64),
                               grouped.reshape(b, t, 2 * kv, hd)], axis=2).reshape(b, t, -1)
    assert xb.grad.dtype == bfloat16
    np.testing.assert_array_equal(xb.grad, expected.astype(np.float32).astype(bfloat16))


def test_gpt_flops_per_token_counts_its_weight_matmuls():
    """2 FLOPs per weight element per token in the blocks' four products and the head, plus 4 t d in attention
    (scores and weighted sum), times 3 for forward and backward: counted from the model's own weights."""
    config = GPTConfig(vocab_size=50, block_size=12, n_layer=3, n_head=8, n_embd=32, n_kv_head=2)
    model = GPT(config, rng=np.random.default_rng(0))
    block_weights = sum(p.data.size for n, p in model.named_parameters()
                        if n.startswith("blocks.") and n.endswith(".weight") and ".ln" not in n)
    expected = 3 * (2 * block_weights + config.n_layer * 4 * config.block_size * config.n_embd
                    + 2 * config.vocab_size * config.n_embd)
    assert model.flops_per_token() == expected
    assert model.blocks[0].attn.qkv.weight.data.shape == (32 + 2 * 2 * 4, 32)


def test_grouped_query_attention_bad_settings_raise_with_the_values():
    with pytest.raises(ValueError, match=r"n_kv_head must be None or an int >= 1 dividing n_head 4 \(got 3\)"):
        GPTConfig(n_head=4, n_embd=8, n_kv_head=3)
    with pytest.raises(ValueError, match=r"n_kv_head must be None or an int >= 1 dividing n_head 4 \(got 0\)"):
        GPTConfig(n_head=4, n_embd=8, n_kv_head=0)
    with pytest.raises(ValueError, match=r"num_heads 4 is not a multiple of num_kv_heads 8"):
        nn.MultiheadAttention(8, 4, num_kv_heads=8)
    with pytest.raises(ValueError, match=r"repeat_kv: num_heads must be a multiple of num_kv_heads >= 1 "
                                         r"\(num_heads=4, num_kv_heads=3\)"):
        F.repeat_kv(np.zeros((1, 2, 40)), 4, 3)
    with pytest.raises(ValueError, match=r"repeat_kv: expected .* num_heads=4, num_kv_heads=2 \(qkv: \(1, 2, 15\)\)"):
        F.repeat_kv(np.zeros((1, 2, 15)), 4, 2)
    gqa = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=4, n_embd=8, n_kv_head=2),
              rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"GPT-2 has multi-head attention only.*n_kv_head=2, n_head=4"):
        to_hf_gpt2(gqa)
    from mpidist.models.hf_gpt2 import save_hf_gpt2
    with pytest.raises(ValueError, match=r"GPT-2 has multi-head attention only"):
        save_hf_gpt2(gqa, "/nonexistent/never-written")


@pytest.mark.world_sizes(2, 4)
def test_kv_heads_that_do_not_split_raise_on_every_rank(comm):
    n = comm.Get_size()
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=8, n_embd=16, n_kv_head=1),
                rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=rf"1 k/v heads \(n_kv_head\) do not split over {n} tensor-parallel ranks"):
        tensor_parallel(model, comm)


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("kind", ["gqa", "llama"])
def test_tensor_parallel_gqa_checkpoint_loads_into_one_process(comm, tmp_path_factory, kind):
    """A TP=2 GPT with 2 k/v heads for 4 saves its q/k/v slices where they lie in the fused projection (``llama``:
    also its SwiGLU gate and up units, RMSNorm and rotary positions): loaded into a plain GPT on one rank, every
    parameter equals single-process training of the same step."""
    from mpidist import checkpoint, optim
    llama = dict(mlp="swiglu", ffn_hidden=20, norm="rmsnorm", positions="rope") if kind == "llama" else {}
    config = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=4, n_embd=16, n_kv_head=2, dtype="float64",
                       **llama)
    tokens = np.random.default_rng(3).integers(0, 32, (2, 9))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def train(model):
        opt = optim.AdamW(list(model.parameters()), lr=0.01)
        model.loss(model(x), y).backward()
        opt.step()
        return model

    root = comm.bcast(str(tmp_path_factory.getbasetemp() / f"tp_{kind}") if comm.Get_rank() == 0 else None, root=0)
    split = train(tensor_parallel(GPT(config, rng=np.random.default_rng(0)), comm, sequence_parallel=False))
    checkpoint.save(root, {"model": split}, comm, step=1)
    plain = GPT(config, rng=np.random.default_rng(1))
    one = comm.Split(comm.Get_rank(), 0)
    checkpoint.load(root, {"model": plain}, one, log=lambda *a: None)
    one.Free()
    single = train(GPT(config, rng=np.random.default_rng(0)))
    loaded = dict(plain.named_parameters())
    for name, p in single.named_parameters():
        np.testing.assert_allclose(loaded[name].data, p.data, rtol=0, atol=1e-12, err_msg=name)
