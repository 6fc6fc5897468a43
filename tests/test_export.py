"""Export and import: safetensors files (mpidist.export) and Hugging Face GPT-2 checkpoints (models.hf_gpt2).

References: the model's own arrays for the safetensors round trip, a GPT-2 forward written here in numpy from
GPT-2's definition (Conv1D ``x @ W + b``, tanh GELU) for the exported tensors, and, when the hf extra is
installed (`make test-hf`), ``transformers.GPT2LMHeadModel`` itself in both directions.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import mpidist
import test_full_state as full_state_tests
from mpidist import full_state_dict
from mpidist.export import config_path, load_safetensors, save_safetensors
from mpidist.models import GPT, GPTConfig
from mpidist.models.hf_gpt2 import gpt_config_from_hf, load_hf_gpt2, save_hf_gpt2, to_hf_gpt2
from mpidist.nn.autograd import no_grad

SHAPE = dict(vocab_size=23, block_size=8, n_layer=2, n_head=2, n_embd=8)


def tiny_gpt(seed=0, **overrides):
    """Return a small GPT whose every parameter (LayerNorms and biases too) is random, so no mapping hides."""
    gpt = GPT(GPTConfig(**{**SHAPE, **overrides}), rng=np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 100)
    for p in gpt.parameters():
        p.data[...] = (rng.standard_normal(p.data.shape) * 0.3).astype(p.data.dtype)
    return gpt.eval()


def logits(gpt, idx):
    with no_grad():
        return np.asarray(gpt(idx).data)


def tokens(seed=1, batch=3, t=SHAPE["block_size"], vocab=SHAPE["vocab_size"]):
    return np.random.default_rng(seed).integers(0, vocab, (batch, t))


# -- safetensors -------------------------------------------------------------------------------------------------

def test_safetensors_round_trip_equals_the_model_bitwise(tmp_path):
    gpt = tiny_gpt(tie_weights=False, dtype="float64")
    path = tmp_path / "out" / "model.safetensors"
    save_safetensors(gpt, path, config=gpt.config, metadata={"note": "test"})
    loaded = load_safetensors(path)
    reference = {name: p.data for name, p in gpt.named_parameters()}
    assert sorted(loaded) == sorted(reference)
    for name, array in reference.items():
        assert loaded[name].dtype == array.dtype and np.array_equal(loaded[name], array), name
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == dataclasses.asdict(gpt.config)
    assert config_path(path) == str(tmp_path / "out" / "config.json")
    with safetensors.safe_open(str(path), framework="np") as f:  # the library's own reader sees the same file
        assert f.metadata() == {"note": "test"}
        assert np.array_equal(f.get_tensor("head.weight"), gpt.head.weight.data)


def test_safetensors_round_trip_keeps_every_storable_dtype_and_layout(tmp_path):
    rng = np.random.default_rng(0)
    matrix = rng.standard_normal((3, 5))
    state = {
        "transposed": matrix.T,                                  # not C-contiguous: written by value
        "big_endian": matrix.astype(">f4"),
        "half": matrix.astype(np.float16),
        "complex64": (matrix + 1j * matrix[::-1]).astype(np.complex64),
        "ints": rng.integers(-9, 9, (4, 2)),
        "flags": rng.random(6) > 0.5,
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.int32),
    }
    path = tmp_path / "state.safetensors"
    save_safetensors(state, path)
    loaded = load_safetensors(path)
    assert sorted(loaded) == sorted(state)
    for name, array in state.items():
        assert loaded[name].shape == array.shape and np.array_equal(loaded[name], array), name
        assert loaded[name].dtype == array.dtype.newbyteorder("<"), name
    assert not (tmp_path / "config.json").exists()  # no config given, none written


def test_load_safetensors_into_a_module_copies_and_checks(tmp_path):
    source, target = tiny_gpt(seed=0), tiny_gpt(seed=1)
    path = tmp_path / "model.safetensors"
    save_safetensors(source, path)
    load_safetensors(path, target)
    assert np.array_equal(logits(target, tokens()), logits(source, tokens()))

    wider = tiny_gpt(seed=2, n_embd=12)
    before = wider.state_dict()
    with pytest.raises(ValueError, match=r"load_safetensors: .*shape mismatch for 'blocks\.0\.attn\.proj\.bias' "
                                         r"\(state_dict: \(8,\), model: \(12,\)\)"):
        load_safetensors(path, wider)
    assert all(np.array_equal(a, wider.state_dict()[n]) for n, a in before.items())  # nothing copied
    # Loading goes through load_full_state_dict: a dtype that casts (float32 into float64) is cast, exactly...
    wide = tiny_gpt(seed=3, dtype="float64")
    load_safetensors(path, wide)
    assert all(np.array_equal(wide.state_dict()[n], a.astype(np.float64)) for n, a in source.state_dict().items())
    # ...one that does not (complex into float) is refused, naming the tensor.
    complex_path = tmp_path / "complex.safetensors"
    save_safetensors({n: a.astype(np.complex64) for n, a in source.state_dict().items()}, complex_path)
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.proj\.bias' has dtype complex64 in the state_dict, which does "
                                         r"not cast to the model's float32"):
        load_safetensors(complex_path, tiny_gpt())
    with pytest.raises(ValueError, match=r"keys do not match the model \(missing: \['head\.weight'\], "
                                         r"unexpected: \[\]\)"):
        load_safetensors(path, tiny_gpt(tie_weights=False))


def test_save_safetensors_refuses_what_safetensors_cannot_store(tmp_path):
    path = tmp_path / "x.safetensors"
    state = {"ok": np.zeros(2), "z": np.zeros(2, np.complex128), "w": np.zeros(1, np.complex128),
             "s": np.array(["a"])}
    with pytest.raises(ValueError, match=r"save_safetensors: safetensors cannot store these dtypes "
                                         r"\(complex128: \['z', 'w'\]; <U1: \['s'\]\)"):
        save_safetensors(state, path)
    with pytest.raises(TypeError, match=r"save_safetensors: metadata must map strings to strings"):
        save_safetensors({"ok": np.zeros(2)}, path, metadata={"step": 3})
    with pytest.raises(TypeError, match=r"save_safetensors: config is not JSON-serializable"):
        save_safetensors({"ok": np.zeros(2)}, path, config={"array": np.zeros(2)})
    with pytest.raises(TypeError, match=r"save_safetensors: tensor names must be strings \(got \[3\]\)"):
        save_safetensors({3: np.zeros(2)}, path)
    with pytest.raises(TypeError, match=r"save_safetensors: expected an nn\.Module, a parallel wrapper or a mapping .*\(got list\)"):
        save_safetensors([np.zeros(2)], path)
    assert not path.exists() and not (tmp_path / "config.json").exists()  # checked before writing anything
    with pytest.raises(IsADirectoryError, match=r"save_safetensors: .* is a directory; name the \.safetensors file"):
        save_safetensors({"ok": np.zeros(2)}, tmp_path)


def test_load_safetensors_reports_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"load_safetensors: no such file \(.*missing\.safetensors\)"):
        load_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(IsADirectoryError, match=r"load_safetensors: .* is a directory"):
        load_safetensors(tmp_path)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ValueError, match=r"load_safetensors: .*garbage\.safetensors cannot be read as numpy "
                                         r"arrays \(.*\); not a safetensors file"):
        load_safetensors(garbage)


# -- Hugging Face GPT-2 ------------------------------------------------------------------------------------------

def hf_names(n_layer, tied):
    """GPT2LMHeadModel's tensor names, written out from its definition."""
    names = ["transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]
    for i in range(n_layer):
        for layer in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            names += [f"transformer.h.{i}.{layer}.weight", f"transformer.h.{i}.{layer}.bias"]
    return sorted(names + ([] if tied else ["lm_head.weight"]))


def gpt2_forward(tensors, config, idx):
    """Return GPT-2's logits for ``idx`` from its checkpoint tensors (GPT-2's definition, in float64 numpy)."""
    t = {name.removeprefix("transformer."): a.astype(np.float64) for name, a in tensors.items()}
    eps, n_head = config["layer_norm_epsilon"], config["n_head"]

    def layer_norm(x, name):
        mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mean) / np.sqrt(var + eps) * t[f"{name}.weight"] + t[f"{name}.bias"]

    def conv1d(x, name):  # Conv1D: weight (in, out)
        return x @ t[f"{name}.weight"] + t[f"{name}.bias"]

    def gelu_new(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    b, n = idx.shape
    x = t["wte.weight"][idx] + t["wpe.weight"][np.arange(n)]
    d = x.shape[-1]
    hd = d // n_head
    causal = np.triu(np.full((n, n), -np.inf), 1)
    for i in range(config["n_layer"]):
        q, k, v = np.split(conv1d(layer_norm(x, f"h.{i}.ln_1"), f"h.{i}.attn.c_attn"), 3, axis=-1)
        q, k, v = (a.reshape(b, n, n_head, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + causal
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        heads = (weights @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
        x = x + conv1d(heads, f"h.{i}.attn.c_proj")
        x = x + conv1d(gelu_new(conv1d(layer_norm(x, f"h.{i}.ln_2"), f"h.{i}.mlp.c_fc")), f"h.{i}.mlp.c_proj")
    head = t["lm_head.weight"] if "lm_head.weight" in t else t["wte.weight"]
    return layer_norm(x, "ln_f") @ head.T


@pytest.mark.parametrize("tie_weights", [True, False])
def test_hf_names_and_layouts_follow_gpt2(tie_weights):
    gpt = tiny_gpt(tie_weights=tie_weights)
    tensors, config = to_hf_gpt2(gpt)
    assert sorted(tensors) == hf_names(SHAPE["n_layer"], tie_weights)
    block = gpt.blocks[1]
    assert np.array_equal(tensors["transformer.h.1.attn.c_attn.weight"], block.attn.qkv.weight.data.T)
    assert np.array_equal(tensors["transformer.h.1.mlp.c_proj.weight"], block.mlp.proj.weight.data.T)
    assert np.array_equal(tensors["transformer.h.1.ln_2.bias"], block.ln2.bias.data)
    assert all(a.flags.c_contiguous for a in tensors.values())
    assert (config["n_positions"], config["n_inner"], config["activation_function"],
            config["tie_word_embeddings"], config["layer_norm_epsilon"]) == (8, 32, "gelu_new", tie_weights, 1e-5)


@pytest.mark.parametrize("overrides", [{}, {"tie_weights": False}, {"bias": False, "mlp_ratio": 2}],
                         ids=["tied", "untied", "no_bias_mlp2"])
def test_exported_tensors_compute_our_logits_in_a_numpy_gpt2(overrides):
    gpt = tiny_gpt(dtype="float64", **overrides)
    tensors, config = to_hf_gpt2(gpt)
    idx = tokens()
    np.testing.assert_allclose(gpt2_forward(tensors, config, idx), logits(gpt, idx), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("tie_weights,ffn_hidden", [(True, None), (False, None), (True, 20)])
def test_hf_round_trip_gives_identical_parameters_and_logits(tmp_path, tie_weights, ffn_hidden):
    """``ffn_hidden`` 20 (no multiple of the width 8): GPT-2's ``n_inner`` carries it both ways."""
    gpt = tiny_gpt(tie_weights=tie_weights, dropout=0.1, ffn_hidden=ffn_hidden)
    save_hf_gpt2(gpt, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    back = load_hf_gpt2(tmp_path / "hf").eval()
    assert back.config == gpt.config
    reference = gpt.state_dict()
    assert list(back.state_dict()) == list(reference)
    for name, array in back.state_dict().items():
        assert array.dtype == reference[name].dtype and np.array_equal(array, reference[name]), name
    assert np.array_equal(logits(back, tokens()), logits(gpt, tokens()))


def test_load_hf_gpt2_reads_names_without_prefix_and_skips_mask_buffers(tmp_path):
    gpt = tiny_gpt()
    tensors, config = to_hf_gpt2(gpt)
    # As the original GPT-2 files store them: no "transformer." prefix, the causal mask saved as buffers.
    bare = {name.removeprefix("transformer."): a for name, a in tensors.items()}
    for i in range(SHAPE["n_layer"]):
        bare[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 8, 8), np.float32))
        bare[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    bare["lm_head.weight"] = gpt.embed.wte.weight.data  # a tied file may still carry the head: equal, accepted
    safetensors.numpy.save_file(bare, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert np.array_equal(logits(load_hf_gpt2(tmp_path).eval(), tokens()), logits(gpt, tokens()))


def write_checkpoint(directory, tensors, config):
    directory.mkdir(exist_ok=True)
    safetensors.numpy.save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("setting, value, message", [
    ("activation_function", "gelu", r"activation_function 'gelu' is not the tanh GELU"),
    ("layer_norm_epsilon", 1e-6, r"layer_norm_epsilon 1e-06 is not this GPT's LayerNorm eps \(1e-05\)"),
    ("scale_attn_by_inverse_layer_idx", True, r"scale_attn_by_inverse_layer_idx True is not supported"),
    ("scale_attn_weights", False, r"scale_attn_weights False is not supported"),
    ("add_cross_attention", True, r"add_cross_attention True is not supported"),
    ("n_inner", 0, r"n_inner 0 is not an int >= 1"),
    ("attn_pdrop", 0.2, r"embd_pdrop, attn_pdrop and resid_pdrop differ .*'attn_pdrop': 0.2"),
    ("model_type", "llama", r"model_type 'llama' is not 'gpt2'"),
    ("n_head", 3, r"n_embd 8 is not divisible by n_head 3"),
])
def test_load_hf_gpt2_refuses_a_config_it_cannot_reproduce(tmp_path, setting, value, message):
    tensors, config = to_hf_gpt2(tiny_gpt())
    write_checkpoint(tmp_path, tensors, {**config, setting: value})
    with pytest.raises(ValueError, match=r"load_hf_gpt2: .*" + message):
        load_hf_gpt2(tmp_path)


def test_load_hf_gpt2_refuses_tensors_that_do_not_fit(tmp_path):
    gpt = tiny_gpt()
    tensors, config = to_hf_gpt2(gpt)
    cases = [
        ({k: v for k, v in tensors.items() if k != "transformer.h.1.ln_2.bias"},
         r"missing: \['transformer\.h\.1\.ln_2\.bias'\], unexpected: \[\]"),
        ({**tensors, "transformer.h.2.ln_1.weight": np.ones(8, np.float32)},
         r"missing: \[\], unexpected: \['transformer\.h\.2\.ln_1\.weight'\]"),
        ({**tensors, "transformer.wpe.weight": np.zeros((9, 8), np.float32)},
         r"wrong shape \(transformer\.wpe\.weight: \(9, 8\) \(config: \(8, 8\)\)"),
        ({**tensors, "lm_head.weight": tensors["transformer.wte.weight"] + 1},
         r"lm_head\.weight differs from transformer\.wte\.weight although tie_word_embeddings is true "
         r"\(max \|difference\|: 1\.0"),
        ({**tensors, "transformer.ln_f.bias": np.zeros(8, np.float64)},
         r"one floating-point dtype \(found \['float32', 'float64'\]\)"),
        ({**tensors, "wte.weight": tensors["transformer.wte.weight"]},
         r"tensor 'wte\.weight' is stored twice"),
    ]
    for i, (bad, message) in enumerate(cases):
        write_checkpoint(tmp_path / str(i), bad, config)
        with pytest.raises(ValueError, match=r"load_hf_gpt2: .*" + message):
            load_hf_gpt2(tmp_path / str(i))


def test_load_hf_gpt2_reports_missing_and_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"load_hf_gpt2: .*no config\.json in the directory"):
        load_hf_gpt2(tmp_path)
    save_hf_gpt2(tiny_gpt(), tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"load_hf_gpt2: .*config\.json is not JSON"):
        load_hf_gpt2(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config\.json is not a JSON object \(got list\)"):
        load_hf_gpt2(tmp_path)
    with pytest.raises(ValueError, match=r"gpt_config_from_hf: this GPT-2 config cannot be reproduced "
                                         r"\(missing settings \['n_positions', 'n_layer'\]\)"):
        gpt_config_from_hf({"vocab_size": 5, "n_embd": 4, "n_head": 2})


def test_to_hf_gpt2_refuses_what_is_not_a_plain_gpt():
    with pytest.raises(TypeError, match=r"to_hf_gpt2: expected a mpidist\.models\.GPT \(got dict\)"):
        to_hf_gpt2({})
    gpt = tiny_gpt()
    gpt.blocks[0].attn.qkv.weight.data = np.zeros((12, 8), np.float32)  # a tensor-parallel slice's shape
    with pytest.raises(ValueError, match=r"to_hf_gpt2: the model is not a plain GPT of its config .*shapes: "
                                         r"\['blocks\.0\.attn\.qkv\.weight: \(12, 8\) \(config: \(24, 8\)\)'\]"):
        to_hf_gpt2(gpt)


# -- any layout: one call gathers (save) or scatters (load); against one process ----------------------------------
# The layouts and the one-process reference of tests/test_full_state.py (float64 GPTs of vocabulary 61 trained
# two AdamW steps): an export from any layout must be the one-process model's export, and a load into any
# layout then training must equal one process trained from the loaded state.

LAYOUTS = [(kind, None) for kind in full_state_tests.KINDS] + [("mesh", (1, 2, 2)), ("mesh", (2, 2, 1))]
LAYOUT_IDS = [kind if dims is None else "x".join(map(str, dims)) for kind, dims in LAYOUTS]


def layout_config(kind):
    return full_state_tests.UNTIED if kind == "pp" else full_state_tests.CONFIG


def build_layout(comm, kind, dims):
    if dims is not None and comm.Get_size() != int(np.prod(dims)):
        pytest.skip(f"the ({', '.join(map(str, dims))}) mesh needs {int(np.prod(dims))} ranks")
    return full_state_tests.Layout(comm, kind, dims)


def rank_of(layout):
    return 0 if layout.comm is None else layout.comm.Get_rank()


def one_process_gpt(config, state):
    gpt = GPT(config, rng=np.random.default_rng(0))
    gpt.load_state_dict(state)
    return gpt


def check_export(layout, config, directory):
    """Train, export as safetensors and as GPT-2 from the layout, and compare with one process's export."""
    layout.train()
    save_safetensors(layout.wrapped, directory / "plain" / "model.safetensors", comm=layout.comm, config=config)
    save_hf_gpt2(layout.wrapped, directory / "hf", layout.comm, config=config)
    if rank_of(layout) != 0:
        return
    want = full_state_tests.one_process(config)
    got = safetensors.numpy.load_file(directory / "plain" / "model.safetensors")
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=full_state_tests.TOL, err_msg=name)
    assert json.loads((directory / "plain" / "config.json").read_text()) == dataclasses.asdict(config)
    want_hf, want_config = to_hf_gpt2(one_process_gpt(config, want))
    got_hf = safetensors.numpy.load_file(directory / "hf" / "model.safetensors")
    assert sorted(got_hf) == sorted(want_hf)
    for name, value in want_hf.items():
        assert got_hf[name].dtype == value.dtype, name
        np.testing.assert_allclose(got_hf[name], value, rtol=0, atol=full_state_tests.TOL, err_msg=name)
    assert json.loads((directory / "hf" / "config.json").read_text()) == json.loads(json.dumps(want_config))


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind, dims", LAYOUTS, ids=LAYOUT_IDS)
def test_export_from_any_layout_equals_the_one_process_export(comm, kind, dims, tmp_path):
    layout = build_layout(comm, kind, dims)
    check_export(layout, layout_config(kind), tmp_path)
    layout.close()


def check_import(layout, config, directory):
    """Load one state through safetensors and another through GPT-2 into the layout; train; against one process."""
    me = rank_of(layout)
    first, second = full_state_tests.other_state(config), GPT(config, rng=np.random.default_rng(4)).state_dict()
    if me == 0:  # the reading rank's files: written by one process
        save_safetensors(first, directory / "model.safetensors")
        save_hf_gpt2(one_process_gpt(config, second), directory / "hf")
    loaded = load_safetensors(directory / "model.safetensors", layout.wrapped, layout.comm)
    assert sorted(loaded) == (sorted(first) if me == 0 else [])
    full_state_tests.assert_state_equals(full_state_dict(layout.wrapped, layout.comm, all_ranks=True), first, 0)
    assert load_hf_gpt2(directory / "hf", layout.wrapped, layout.comm, config=config) is layout.wrapped
    full_state_tests.assert_state_equals(full_state_dict(layout.wrapped, layout.comm, all_ranks=True), second, 0)
    layout.train()
    got = full_state_dict(layout.wrapped, layout.comm)
    if me == 0:
        full_state_tests.assert_state_equals(got, full_state_tests.one_process(config, second), full_state_tests.TOL)


@pytest.mark.world_sizes(1, 2, 4)
@pytest.mark.parametrize("kind, dims", LAYOUTS, ids=LAYOUT_IDS)
def test_import_into_any_layout_then_training_equals_one_process(comm, kind, dims, tmp_path):
    layout = build_layout(comm, kind, dims)
    check_import(layout, layout_config(kind), tmp_path)
    layout.close()


def _export_and_import_3d(comm, directory):
    for check, where in ((check_export, "export"), (check_import, "import")):
        layout = full_state_tests.Layout(comm, "mesh", (2, 2, 2))
        check(layout, full_state_tests.CONFIG, directory / where)
        layout.close()


@pytest.mark.mpi_skip  # simulated ranks only: under mpiexec every rank would run all eight again
def test_export_and_import_at_dp2_pp2_tp2(tmp_path):
    mpidist.simulate(8, _export_and_import_3d, tmp_path)


@pytest.mark.world_sizes(2, 4)
def test_a_failed_export_or_import_raises_on_every_rank(comm, tmp_path):
    layout = full_state_tests.Layout(comm, "fsdp")
    config = full_state_tests.CONFIG
    with pytest.raises(TypeError, match=r"save_hf_gpt2: pass config=, the GPTConfig of the model, with a FSDP"):
        save_hf_gpt2(layout.wrapped, tmp_path / "hf", layout.comm)
    occupied = tmp_path / "occupied"  # rank 0's target is a file where the directory should be
    if comm.Get_rank() == 0:
        occupied.write_text("not a directory")
    with pytest.raises((OSError, RuntimeError), match=r"save_hf_gpt2: rank 0: "):
        save_hf_gpt2(layout.wrapped, occupied, layout.comm, config=config)
    with pytest.raises(IsADirectoryError, match=r"save_safetensors: rank 0: IsADirectoryError: .* is a directory"):
        save_safetensors(layout.wrapped, tmp_path, comm=layout.comm)
    with pytest.raises(FileNotFoundError, match=r"load_safetensors: rank 0: FileNotFoundError: .*no such file"):
        load_safetensors(tmp_path / "missing.safetensors", layout.wrapped, layout.comm)
    other = dataclasses.replace(config, n_head=2)  # same tensor shapes, another model
    if comm.Get_rank() == 0:
        save_hf_gpt2(one_process_gpt(other, GPT(other, rng=np.random.default_rng(0)).state_dict()), tmp_path / "hf2")
    before = full_state_dict(layout.wrapped, layout.comm, all_ranks=True)
    with pytest.raises(ValueError, match=r"the checkpoint is not of the model's shape \(n_head 2 \(model: 4\)\)"):
        load_hf_gpt2(tmp_path / "hf2", layout.wrapped, layout.comm, config=config)
    full_state_tests.assert_state_equals(full_state_dict(layout.wrapped, layout.comm, all_ranks=True), before, 0)
    layout.close()


# -- against transformers itself (the hf extra) ------------------------------------------------------------------

@pytest.fixture
def transformers(request):
    """transformers and torch, in a single process: these checks use no communicator."""
    if request.config.getoption("with_mpi", default=False):
        pytest.skip("a single-process check against transformers: runs without --with-mpi (make test-hf)")
    pytest.importorskip("torch", reason="torch is not installed (the hf extra: make test-hf)")
    return pytest.importorskip("transformers", reason="transformers is not installed (the hf extra: make test-hf)")


@pytest.mark.slow
@pytest.mark.parametrize("tie_weights", [True, False])
def test_transformers_loads_our_export_and_gives_our_logits(tmp_path, transformers, tie_weights):
    import torch
    gpt = tiny_gpt(tie_weights=tie_weights)
    save_hf_gpt2(gpt, tmp_path)
    model, info = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert {k: sorted(v) for k, v in info.items() if k != "error_msgs"} == \
        {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    model.eval()
    idx = tokens()
    with torch.no_grad():
        theirs = model(torch.from_numpy(idx)).logits.numpy()
    assert theirs.dtype == np.float32
    np.testing.assert_allclose(logits(gpt, idx), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tie_weights", [True, False])
def test_a_checkpoint_made_by_transformers_loads_and_gives_its_logits(tmp_path, transformers, tie_weights):
    import torch
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=29, n_positions=12, n_embd=16, n_layer=2, n_head=4, tie_word_embeddings=tie_weights,
        bos_token_id=None, eos_token_id=None))
    with torch.no_grad():  # LayerNorms start at (1, 0) and biases at 0: make every tensor tell
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.eval()
    model.save_pretrained(str(tmp_path))
    gpt = load_hf_gpt2(tmp_path).eval()
    assert (gpt.config.n_layer, gpt.config.block_size, gpt.config.tie_weights) == (2, 12, tie_weights)
    idx = tokens(batch=2, t=12, vocab=29)
    with torch.no_grad():
        theirs = model(torch.from_numpy(idx)).logits.numpy()
    np.testing.assert_allclose(logits(gpt, idx), theirs, rtol=1e-5, atol=1e-6)
