"""Llama's blocks: SwiGLU (``F.swiglu``, ``nn.MLP(activation="swiglu")``, ``GPTConfig(mlp="swiglu",
ffn_hidden=)``), RMSNorm (``GPTConfig(norm="rmsnorm")``) and rotary positions (``F.rotary``,
``GPTConfig(positions="rope")``) against independent references: numpy's ``gate / (1 + exp(-gate)) * up`` and
complex multiplication by exp(i p theta) in float64, central finite differences, a count of the weight matmuls'
FLOPs, and rotary's defining property (q . k depends on the positions' difference only); the split model against
one process in tests/test_tensor_parallel.py
(``test_llama_blocks_train_like_one_process``) and in tests/test_gqa.py (a tensor-parallel checkpoint loaded into
one process, ``[llama]``);
the planner's parameters, calls and activations in tests/test_plan.py and tests/test_plan_exact.py."""
import re

import numpy as np
import pytest

from mpidist import nn
from mpidist.models.gpt import GPT, GPTConfig
from mpidist.models.gpt_parallel import tensor_parallel
from mpidist.models.hf_gpt2 import hf_gpt2_config, to_hf_gpt2
from mpidist.nn import functional as F
from mpidist.nn.precision import bfloat16
from mpidist.plan import ModelShape
from tests.gradcheck import gradcheck


def reference_swiglu(x):
    """float64 numpy, by the textbook formula: silu(gate) * up of x = [gate | up] along the last axis."""
    x = np.asarray(x, dtype=np.float64)
    f = x.shape[-1] // 2
    gate, up = x[..., :f], x[..., f:]
    with np.errstate(over="ignore"):   # exp(-gate) overflows to inf for very negative gates: silu -> -0
        return gate / (1.0 + np.exp(-gate)) * up


def reference_swiglu_grad(x, g):
    x, g = np.asarray(x, dtype=np.float64), np.asarray(g, dtype=np.float64)
    f = x.shape[-1] // 2
    gate, up = x[..., :f], x[..., f:]
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-gate))
    return np.concatenate([g * up * (s + gate * s * (1 - s)), g * gate * s], axis=-1)


@pytest.mark.parametrize("block_rows", [None, 3], ids=["one-block", "row-blocks-of-3"])
@pytest.mark.parametrize("shape", [(2, 5, 16), (7, 2), (3, 1, 4, 10)], ids=str)
def test_swiglu_equals_silu_gate_times_up(monkeypatch, block_rows, shape):
    """Forward and backward equal the float64 formula, in one row block and in row blocks of 3 rows (the last
    one shorter), including gates of +-60 (exp(60) would overflow float32; here it keeps silu's tiny values)."""
    if block_rows:
        monkeypatch.setattr(F, "_CHUNK", block_rows * (shape[-1] // 2))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 3
    x.reshape(-1)[:2] = (60.0, -60.0)
    t = nn.Tensor(x, requires_grad=True)
    y = F.swiglu(t)
    assert y.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_allclose(y.data, reference_swiglu(x), rtol=1e-13, atol=1e-300)
    g = rng.standard_normal(y.shape)
    y.backward(nn.Tensor(g))
    np.testing.assert_allclose(t.grad, reference_swiglu_grad(x, g), rtol=1e-12, atol=1e-300)


def test_swiglu_gradients_are_central_differences(monkeypatch):
    rng = np.random.default_rng(1)
    gradcheck(lambda a: F.swiglu(a), rng.standard_normal((3, 4, 12)))
    monkeypatch.setattr(F, "_CHUNK", 12)   # two rows per block
    gradcheck(lambda a: F.swiglu(a), rng.standard_normal((5, 12)))


@pytest.mark.parametrize("dtype", [bfloat16, np.float16], ids=["bfloat16", "float16"])
def test_16_bit_swiglu_computes_in_float32_and_rounds_once(monkeypatch, dtype):
    """A 16-bit input's output and gradient keep its dtype and equal the float64 formula on the same (rounded)
    inputs within one rounding of the 16-bit type: no error builds up over the passes."""
    monkeypatch.setattr(F, "_CHUNK", 40)   # several row blocks, the scratch rows reused
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((9, 20)) * 2).astype(dtype)
    g = rng.standard_normal((9, 10)).astype(dtype)
    t = nn.Tensor(x, requires_grad=True)
    y = F.swiglu(t)
    y.backward(nn.Tensor(g))
    assert y.data.dtype == dtype and t.grad.dtype == dtype
    eps = 2.0 ** -8 if dtype is bfloat16 else 2.0 ** -11   # one rounding of the 16-bit type
    want, want_grad = reference_swiglu(x), reference_swiglu_grad(x, g)
    np.testing.assert_allclose(y.data.astype(np.float64), want, rtol=eps, atol=1e-6)
    np.testing.assert_allclose(t.grad.astype(np.float64), want_grad, rtol=eps, atol=1e-6)


def test_swiglu_mlp_is_proj_of_silu_gate_times_up():
    """``nn.MLP(activation="swiglu")``: fc holds the gate's rows then up's; the output is
    ``proj(silu(x Wg^T + bg) * (x Wu^T + bu))`` by numpy, and its gradients central differences."""
    rng = np.random.default_rng(3)
    mlp = nn.MLP(8, 6, activation="swiglu", rng=rng, dtype=np.float64)
    assert mlp.fc.weight.data.shape == (12, 8) and mlp.proj.weight.data.shape == (8, 6)
    x = rng.standard_normal((2, 3, 8))
    w, b = mlp.fc.weight.data, mlp.fc.bias.data
    gate, up = x @ w[:6].T + b[:6], x @ w[6:].T + b[6:]
    want = (gate / (1 + np.exp(-gate)) * up) @ mlp.proj.weight.data.T + mlp.proj.bias.data
    np.testing.assert_allclose(mlp(nn.Tensor(x)).data, want, rtol=1e-12, atol=1e-14)
    gradcheck(lambda a: mlp(a), x, module=mlp)


def test_swiglu_gpt_counts_its_weight_matmuls_and_the_planner_agrees():
    """A Llama-shaped GPT (SwiGLU of ffn_hidden units, not a multiple of the width; grouped-query attention; no
    biases): 2 FLOPs per weight element per token in the blocks and the head, plus 4 t d in attention, times 3;
    its parameters are 3 d f per MLP; the planner's shape counts the same."""
    config = GPTConfig(vocab_size=50, block_size=12, n_layer=3, n_head=8, n_embd=32, n_kv_head=2, mlp="swiglu",
                       ffn_hidden=88, bias=False)
    model = GPT(config, rng=np.random.default_rng(0))
    assert model.blocks[0].mlp.fc.weight.data.shape == (2 * 88, 32)
    assert model.blocks[0].mlp.proj.weight.data.shape == (32, 88) and model.blocks[0].mlp.fc.bias is None
    block_weights = sum(p.data.size for n, p in model.named_parameters()
                        if n.startswith("blocks.") and n.endswith(".weight") and ".ln" not in n)
    expected = 3 * (2 * block_weights + config.n_layer * 4 * config.block_size * config.n_embd
                    + 2 * config.vocab_size * config.n_embd)
    assert model.flops_per_token() == expected
    shape = ModelShape.from_config(config)
    assert (shape.mlp, shape.ffn_size, shape.fc_size) == ("swiglu", 88, 176)
    assert shape.flops_per_token() == expected and shape.num_parameters() == model.num_parameters()
    y = model(np.zeros((1, 4), dtype=np.int64))
    assert y.shape == (1, 4, 50)


@pytest.mark.mpi_skip  # one process, no communicator: under mpiexec every rank would repeat it
def test_a_llama_shaped_gpt_has_rmsnorms_and_its_gradients_are_central_differences():
    """``GPTConfig(norm="rmsnorm", positions="rope", mlp="swiglu", n_kv_head=, bias=False)``: every norm is an
    RMSNorm (a weight, no bias), there is no position table, and the whole model's loss gradients, every
    parameter's, are central differences (float64)."""
    config = GPTConfig(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=8, n_kv_head=1, mlp="swiglu",
                       ffn_hidden=6, bias=False, norm="rmsnorm", positions="rope", tie_weights=False,
                       dtype="float64")
    model = GPT(config, rng=np.random.default_rng(5))
    norms = [model.blocks[0].ln1, model.blocks[0].ln2, model.head.ln_f]
    assert all(isinstance(n, nn.RMSNorm) for n in norms)
    assert not any(".bias" in name or "wpe" in name for name, _ in model.named_parameters())
    assert model.blocks[0].attn.rope and model.num_parameters(non_embedding=True) == model.num_parameters()
    tokens = np.random.default_rng(6).integers(0, 7, (2, 5))
    gradcheck(lambda: model.loss(model(tokens[:, :-1]), tokens[:, 1:]), module=model)


def reference_rotary(x, heads, kv_heads, base=10000.0, sign=1):
    """float64 numpy: each q and k head's channels (i, i + hd/2) as the complex number x_i + i x_{i+hd/2},
    multiplied by exp(sign i p base^(-2i/hd)) at position p; v unchanged."""
    b, t, width = x.shape
    hd = width // (heads + 2 * kv_heads)
    parts = np.asarray(x, dtype=np.float64).reshape(b, t, heads + 2 * kv_heads, hd).copy()
    half = hd // 2
    z = parts[..., :heads + kv_heads, :half] + 1j * parts[..., :heads + kv_heads, half:]
    angle = np.arange(t)[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]
    z = z * np.exp(sign * 1j * angle)[None, :, None, :]
    parts[..., :heads + kv_heads, :half], parts[..., :heads + kv_heads, half:] = z.real, z.imag
    return parts.reshape(b, t, width)


@pytest.mark.parametrize("heads,kv_heads,base", [(4, 4, 10000.0), (4, 2, 10000.0), (6, 1, 500000.0)])
def test_rotary_turns_q_and_k_by_their_positions(heads, kv_heads, base):
    """``F.rotary`` equals the complex-number reference (v untouched), its gradients are central differences,
    and the scores it leads to depend on positions through their difference only: q at p and k at s score as
    q at p + 3 and k at s + 3."""
    rng = np.random.default_rng(7)
    hd, t = 6, 9
    x = rng.standard_normal((2, t, (heads + 2 * kv_heads) * hd))
    y = F.rotary(nn.Tensor(x), heads, kv_heads, base).data
    np.testing.assert_allclose(y, reference_rotary(x, heads, kv_heads, base), rtol=1e-13, atol=1e-13)
    gradcheck(lambda a: F.rotary(a, heads, kv_heads, base), x[:, :4])
    # the same q and k vectors at every position: the scores q_p . k_s of the turned ones depend on p - s
    q, k = rng.standard_normal(hd), rng.standard_normal(hd)
    same = np.zeros((1, t, (heads + 2 * kv_heads) * hd))
    parts = same.reshape(1, t, heads + 2 * kv_heads, hd)
    parts[:, :, 0], parts[:, :, heads] = q, k
    turned = F.rotary(nn.Tensor(same), heads, kv_heads, base).data.reshape(1, t, heads + 2 * kv_heads, hd)
    scores = turned[0, :, 0] @ turned[0, :, heads].T   # (p, s)
    np.testing.assert_allclose(scores[3:, 3:], scores[:-3, :-3], rtol=1e-12, atol=1e-12)
    assert not np.allclose(scores[0, 1], scores[0, 2])


@pytest.mark.parametrize("dtype", [bfloat16, np.float16], ids=["bfloat16", "float16"])
def test_16_bit_rotary_rounds_once(dtype):
    """A 16-bit input is turned in float32 and rounded once: within one 16-bit rounding of the float64 reference;
    its gradient is the rotation's transpose."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 7, 6 * 4)).astype(dtype)
    g = rng.standard_normal((2, 7, 6 * 4)).astype(dtype)
    t = nn.Tensor(x, requires_grad=True)
    y = F.rotary(t, 2, 2)
    y.backward(nn.Tensor(g))
    eps = 2.0 ** -8 if dtype is bfloat16 else 2.0 ** -11
    assert y.data.dtype == dtype and t.grad.dtype == dtype
    np.testing.assert_allclose(y.data.astype(np.float64), reference_rotary(x, 2, 2), rtol=eps, atol=1e-6)
    # backward is the rotation's transpose: g turned by the negative angles
    np.testing.assert_allclose(t.grad.astype(np.float64), reference_rotary(g, 2, 2, sign=-1), rtol=eps, atol=1e-6)


def test_swiglu_bad_settings_raise_with_the_values():
    with pytest.raises(ValueError, match=r"mlp must be one of \('gelu', 'swiglu'\) \(got 'relu'\)"):
        GPTConfig(mlp="relu")
    with pytest.raises(ValueError, match=r"ffn_hidden must be None or an int >= 1 \(got 0\)"):
        GPTConfig(ffn_hidden=0)
    with pytest.raises(ValueError, match=r"ffn_hidden must be None or an int >= 1 \(got 2.5\)"):
        GPTConfig(ffn_hidden=2.5)
    with pytest.raises(ValueError, match=r"MLP: activation must be one of \('gelu', 'swiglu'\) \(got 'geglu'\)"):
        nn.MLP(4, 8, activation="geglu")
    for shape in ((2, 5), (3, 0)):
        with pytest.raises(ValueError, match=r"swiglu: the last axis holds \[gate \| up\] and must have an even, "
                                             rf"non-zero length \(got shape {re.escape(str(shape))}\)"):
            F.swiglu(np.zeros(shape))
    with pytest.raises(ValueError, match=r"MLP: hidden must be an int >= 1 \(got 0\)"):
        nn.MLP(4, 0, activation="swiglu")
    with pytest.raises(ValueError, match=r"ModelShape: mlp must be one of \('gelu', 'swiglu'\) \(got 'GELU'\)"):
        ModelShape(layers=1, hidden=8, heads=2, vocab=11, seq=4, mlp="GELU")
    with pytest.raises(ValueError, match=r"norm must be one of \('layernorm', 'rmsnorm'\) \(got 'rms'\)"):
        GPTConfig(norm="rms")
    with pytest.raises(ValueError, match=r"ModelShape: norm must be one of \('layernorm', 'rmsnorm'\) "
                                         r"\(got 'batchnorm'\)"):
        ModelShape(layers=1, hidden=8, heads=2, vocab=11, seq=4, norm="batchnorm")
    rms = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8, norm="rmsnorm"),
              rng=np.random.default_rng(0))
    for export in (to_hf_gpt2, hf_gpt2_config):   # refused as RMSNorm, not for its norms' eps
        with pytest.raises(ValueError, match=r"GPT-2's norms are LayerNorms; this model's are 'rmsnorm'"):
            export(rms)
    with pytest.raises(ValueError, match=r"positions must be one of \('learned', 'rope'\) \(got 'alibi'\)"):
        GPTConfig(positions="alibi")
    with pytest.raises(ValueError, match=r"rotary positions need an even head size \(n_embd 12 / n_head 4 = 3\)"):
        GPTConfig(n_embd=12, n_head=4, positions="rope")
    for base in (0, float("inf"), "x"):
        with pytest.raises(ValueError, match=rf"rope_base must be a finite number > 0 \(got {re.escape(repr(base))}\)"):
            GPTConfig(positions="rope", rope_base=base)
    with pytest.raises(ValueError, match=r"rope_base 500000.0 is set but positions is 'learned'"):
        GPTConfig(rope_base=500000.0)
    assert GPTConfig(positions="rope", rope_base=np.float32(5e5)).rope_base == 5e5
    with pytest.raises(ValueError, match=r"MultiheadAttention: rotary positions turn channel pairs: the head size 3 "
                                         r"must be even"):
        nn.MultiheadAttention(12, 4, rope=True)
    with pytest.raises(ValueError, match=r"MultiheadAttention: rope_base must be a finite number > 0 \(got -1\)"):
        nn.MultiheadAttention(8, 2, rope=True, rope_base=-1)
    with pytest.raises(ValueError, match=r"rotary: num_heads must be a multiple of num_kv_heads >= 1 "
                                         r"\(num_heads=4, num_kv_heads=3\)"):
        F.rotary(np.zeros((1, 2, 40)), 4, 3)
    with pytest.raises(ValueError, match=r"rotary: base must be a finite number > 0 \(got 'x'\)"):
        F.rotary(np.zeros((1, 2, 24)), 2, 2, base="x")
    with pytest.raises(ValueError, match=r"ModelShape: rotary positions need an even head size \(hidden 12 / heads "
                                         r"4 = 3\)"):
        ModelShape(layers=1, hidden=12, heads=4, vocab=11, seq=4, positions="rope")
    with pytest.raises(ValueError, match=r"ModelShape: positions must be one of \('learned', 'rope'\) "
                                         r"\(got 'RoPE'\)"):
        ModelShape(layers=1, hidden=8, heads=2, vocab=11, seq=4, positions="RoPE")
    with pytest.raises(ValueError, match=r"rotary: expected .* an even head_dim, num_heads=2, num_kv_heads=2 "
                                         r"\(qkv: \(1, 3, 18\)\)"):
        F.rotary(np.zeros((1, 3, 18)), 2)
    rope = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8, positions="rope"),
               rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"GPT-2's positions are a learned table; this model's are 'rope'"):
        to_hf_gpt2(rope)
    llama = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=2, n_embd=8, mlp="swiglu"),
                rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"GPT-2's MLP is GELU; this model's is 'swiglu'"):
        to_hf_gpt2(llama)


@pytest.mark.world_sizes(2, 4)
def test_swiglu_hidden_units_that_do_not_split_raise_on_every_rank(comm):
    n = comm.Get_size()
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=4, n_embd=16, mlp="swiglu",
                          ffn_hidden=2 * n + 1), rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=rf"a SwiGLU MLP's {2 * n + 1} hidden units \(ffn_hidden\) do not split "
                                         rf"over {n} tensor-parallel ranks"):
        tensor_parallel(model, comm)
