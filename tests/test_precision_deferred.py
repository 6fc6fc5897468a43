"""A deferred GPT under a 16-bit policy materializes, wrapped at any layout, into the one-process model's values.

Reference: one process's ``materialize`` of the same deferred GPT (same seed) under the same policy: its
``state_dict()`` bitwise, and its loss on each rank's batch bitwise (the same 16-bit weights, the same ops)."""

import numpy as np
import pytest

from mpidist import nn
from mpidist.models import GPT, GPTConfig
from mpidist.nn.deferred import is_deferred
from mpidist.nn.precision import Policy, apply_policy, bfloat16
from mpidist.parallel import DDP, FSDP, full_state_dict

CONFIG = GPTConfig(vocab_size=61, block_size=8, n_layer=2, n_head=4, n_embd=16)
SEED, BATCH = 23, 4


def deferred_gpt(policy):
    with nn.deferred(seed=SEED):
        model = GPT(CONFIG)
    apply_policy(model, policy)
    return model


def test_policy_makes_deferred_parameters_deferred_in_its_dtype():
    model = deferred_gpt(Policy("bf16"))
    for name, p in model.named_parameters():
        assert is_deferred(p) and p.data.dtype == bfloat16, name
    eager = nn.materialize(model)
    with nn.deferred(seed=SEED):
        float32_model = nn.materialize(GPT(CONFIG))
    # Drawn in float64 and rounded once to bfloat16: within one bfloat16 ulp of the float32 draw.
    for (name, p), q in zip(eager.named_parameters(), float32_model.parameters()):
        np.testing.assert_allclose(p.data.astype(np.float32), q.data, rtol=2 ** -8, atol=0, err_msg=name)


@pytest.mark.world_sizes(2)
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("policy", [Policy("bf16"), Policy("bf16", "fp32")], ids=["bf16", "bf16_fp32"])
def test_deferred_model_under_policy_wraps_like_one_process(comm, kind, policy):
    model = deferred_gpt(policy)
    wrapped = DDP(model, comm) if kind == "ddp" else FSDP(model, comm, units=model.fsdp_units())
    try:
        got = full_state_dict(wrapped, comm, rank=0)
        want_model = nn.materialize(deferred_gpt(policy))
        if comm.Get_rank() == 0:
            want = want_model.state_dict()
            assert list(got) == list(want)
            for name, value in want.items():
                assert got[name].dtype == value.dtype == bfloat16, name
                assert got[name].tobytes() == value.tobytes(), name
        rng = np.random.default_rng([7, comm.Get_rank()])
        x = rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
        y = rng.integers(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
        loss = model.loss(wrapped(x), y)
        want_loss = want_model.loss(want_model(x), y)
        assert np.asarray(loss.data).tobytes() == np.asarray(want_loss.data).tobytes()
    finally:
        wrapped.remove()
