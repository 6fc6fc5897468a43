"""``models.GPT`` under Hugging Face GPT-2's tensor names, layouts and config: export for ``transformers``, and
import of GPT-2-shaped checkpoints (so a run can start from a published small GPT-2 stored locally).

Glossary. *HF name*: the name ``transformers.GPT2LMHeadModel`` gives a tensor (``transformer.h.0.attn.c_attn.weight``).
*Conv1D*: GPT-2's linear layer, which stores its weight as (in, out), the transpose of our ``Linear``'s (out, in).
*Tied*: the LM head reads the token embedding's weight (``tie_weights`` here, ``tie_word_embeddings`` there); a
tied checkpoint has no ``lm_head.weight``.

The two models compute the same function: pre-norm blocks, attention scaled by 1/sqrt(head_dim), our fused qkv
(reshaped (b, t, 3, heads, head_dim)) split exactly as GPT-2's ``c_attn``, and GELU with the tanh approximation
(``nn.functional.gelu``), which transformers calls ``gelu_new`` (also ``gelu_pytorch_tanh``; plain ``gelu`` is
the erf form and is refused). One dropout rate here stands for GPT-2's ``embd_pdrop``, ``attn_pdrop`` and
``resid_pdrop``, which sit in the same places. A config setting our GPT cannot reproduce is refused by name.

Any layout: ``save_hf_gpt2`` takes a GPT or a wrapper of one at any layout (DDP, FSDP, hybrid, tensor parallel,
Pipeline, a 3-D mesh); the unsplit tensors stream to one rank (``mpidist.full_state_dict``), which writes.
``load_hf_gpt2(directory, model)`` scatters a checkpoint into such a model (``load_full_state_dict``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import numpy as np

from mpidist.export import CONFIG_NAME, gather_state, layout_comm, on_rank, read_safetensors, save_safetensors
from mpidist.models.gpt import GPT, GPTConfig
from mpidist.nn.layers import LayerNorm
from mpidist.nn.module import Module
from mpidist.parallel.full_state import load_full_state_dict
from mpidist.parallel.interface import Wrapper
from mpidist.parallel.tensor import ParallelLayerNorm
from mpidist.xp import to_numpy

__all__ = ["WEIGHTS_NAME", "hf_gpt2_config", "gpt_config_from_hf", "to_hf_gpt2", "save_hf_gpt2", "load_hf_gpt2"]

WEIGHTS_NAME = "model.safetensors"

# Our name inside a block -> GPT-2's, and whether the weight is a Conv1D (stored transposed there).
_BLOCK_NAMES = (
    ("ln1.weight", "ln_1.weight", False), ("ln1.bias", "ln_1.bias", False),
    ("attn.qkv.weight", "attn.c_attn.weight", True), ("attn.qkv.bias", "attn.c_attn.bias", False),
    ("attn.proj.weight", "attn.c_proj.weight", True), ("attn.proj.bias", "attn.c_proj.bias", False),
    ("ln2.weight", "ln_2.weight", False), ("ln2.bias", "ln_2.bias", False),
    ("mlp.fc.weight", "mlp.c_fc.weight", True), ("mlp.fc.bias", "mlp.c_fc.bias", False),
    ("mlp.proj.weight", "mlp.c_proj.weight", True), ("mlp.proj.bias", "mlp.c_proj.bias", False),
)
# Older GPT-2 files carry each block's causal mask as buffers; the mask is implied by a causal GPT.
_MASK_BUFFERS = ("attn.bias", "attn.masked_bias")
# GELU with the tanh approximation, under the names transformers gives it (ours: nn.functional.gelu).
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_DROPOUTS = ("embd_pdrop", "attn_pdrop", "resid_pdrop")
# What a checkpoint loaded into an existing model must match (dropout and dtype are the model's to keep).
_SHAPE_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "ffn_size", "bias", "tie_weights")
# The eps of every LayerNorm a GPT builds (it passes none): what a wrapper's export states.
_DEFAULT_EPS = LayerNorm(1).eps


def _gpt2_shaped(config: GPTConfig) -> None:
    """Raise ValueError when a GPT of ``config`` has no GPT-2 equivalent (grouped-query attention, a SwiGLU MLP,
    RMSNorm)."""
    if config.kv_heads != config.n_head:
        raise ValueError(f"hf_gpt2: GPT-2 has multi-head attention only; this model has grouped-query attention "
                         f"(n_kv_head={config.n_kv_head}, n_head={config.n_head})")
    if config.mlp != "gelu":
        raise ValueError(f"hf_gpt2: GPT-2's MLP is GELU; this model's is {config.mlp!r} (GPTConfig.mlp)")
    if config.positions != "learned":
        raise ValueError(f"hf_gpt2: GPT-2's positions are a learned table; this model's are {config.positions!r} "
                         f"(GPTConfig.positions)")
    if config.norm != "layernorm":
        raise ValueError(f"hf_gpt2: GPT-2's norms are LayerNorms; this model's are {config.norm!r} (GPTConfig.norm)")


def _name_table(config: GPTConfig) -> List[Tuple[str, str, bool, Tuple[int, ...]]]:
    """Return (our name, HF name, transposed, our shape) for every tensor of a GPT-2 of this shape, in HF's order."""
    _gpt2_shaped(config)
    d, hidden = config.n_embd, config.ffn_size
    shapes = {"ln1": (d,), "ln2": (d,), "attn.qkv": (3 * d, d), "attn.proj": (d, d), "mlp.fc": (hidden, d),
              "mlp.proj": (d, hidden)}
    table = [("embed.wte.weight", "transformer.wte.weight", False, (config.vocab_size, d)),
             ("embed.wpe.weight", "transformer.wpe.weight", False, (config.block_size, d))]
    for i in range(config.n_layer):
        for ours, hf, transposed in _BLOCK_NAMES:
            layer, kind = ours.rsplit(".", 1)
            shape = shapes[layer] if kind == "weight" else shapes[layer][:1]
            table.append((f"blocks.{i}.{ours}", f"transformer.h.{i}.{hf}", transposed, shape))
    table += [("head.ln_f.weight", "transformer.ln_f.weight", False, (d,)),
              ("head.ln_f.bias", "transformer.ln_f.bias", False, (d,))]
    if not config.tie_weights:
        table.append(("head.weight", "lm_head.weight", False, (config.vocab_size, d)))
    return table


def _layer_norm_eps(gpt: GPT, context) -> float:
    eps = {m.eps for m in gpt.modules() if isinstance(m, (LayerNorm, ParallelLayerNorm))}
    if len(eps) != 1:
        raise ValueError(f"{context}: GPT-2 has one layer_norm_epsilon, this model's LayerNorms have {sorted(eps)}")
    return eps.pop()


def hf_gpt2_config(gpt: GPT) -> dict:
    """Return the ``config.json`` of the Hugging Face GPT-2 that computes what ``gpt`` computes."""
    _gpt2_shaped(gpt.config)   # first: an RMSNorm model is refused as such, not for its norms' eps
    return _hf_config(gpt.config, _layer_norm_eps(gpt, "hf_gpt2_config"))


def _hf_config(c: GPTConfig, layer_norm_eps: float) -> dict:
    _gpt2_shaped(c)
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": c.vocab_size, "n_positions": c.block_size, "n_embd": c.n_embd, "n_layer": c.n_layer,
        "n_head": c.n_head, "n_inner": c.ffn_size, "activation_function": _TANH_GELU[0],
        **{name: c.dropout for name in _DROPOUTS},
        "layer_norm_epsilon": layer_norm_eps,
        "initializer_range": 0.02, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False, "add_cross_attention": False, "use_cache": True,
        "tie_word_embeddings": c.tie_weights,
        # transformers' defaults (50256) lie outside a small vocabulary and make it warn; a byte-level GPT has none.
        "bos_token_id": None, "eos_token_id": None,
        "dtype": c.dtype, "torch_dtype": c.dtype,  # transformers >= 4.56 reads "dtype", earlier ones "torch_dtype"
    }


def gpt_config_from_hf(hf: Mapping, dtype="float32", context="gpt_config_from_hf") -> GPTConfig:
    """Return the GPTConfig of a GPT-2 ``config.json``; raise ValueError naming each setting we cannot reproduce."""
    problems = []

    def setting(name, default):
        return hf.get(name, default)

    model_type = setting("model_type", "gpt2")
    if model_type != "gpt2":
        problems.append(f"model_type {model_type!r} is not 'gpt2'")
    missing = [name for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if name not in hf]
    if missing:
        problems.append(f"missing settings {missing}")
    activation = setting("activation_function", "gelu_new")
    if activation not in _TANH_GELU:
        problems.append(f"activation_function {activation!r} is not the tanh GELU of this GPT ({list(_TANH_GELU)})")
    for name, ours in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("add_cross_attention", False)):
        if bool(setting(name, ours)) != ours:
            problems.append(f"{name} {setting(name, ours)!r} is not supported (only {ours})")
    dropouts = {name: setting(name, 0.1) for name in _DROPOUTS}
    if len(set(dropouts.values())) != 1:
        problems.append(f"embd_pdrop, attn_pdrop and resid_pdrop differ ({dropouts}); this GPT has one dropout rate")
    n_embd, n_inner = hf.get("n_embd"), setting("n_inner", None)
    mlp_ratio, ffn_hidden = 4, None
    if n_inner is not None and isinstance(n_embd, int) and n_embd > 0:
        if not isinstance(n_inner, int) or isinstance(n_inner, bool) or n_inner < 1:
            problems.append(f"n_inner {n_inner!r} is not an int >= 1")
        elif n_inner % n_embd:
            ffn_hidden = n_inner   # GPTConfig(ffn_hidden=...): any width, as GPT-2's n_inner
        else:
            mlp_ratio = n_inner // n_embd
    if problems:
        raise ValueError(f"{context}: this GPT-2 config cannot be reproduced ({'; '.join(problems)})")
    try:
        return GPTConfig(vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
                         n_head=hf["n_head"], n_embd=n_embd, mlp_ratio=mlp_ratio, ffn_hidden=ffn_hidden,
                         dropout=dropouts["embd_pdrop"], bias=True,
                         tie_weights=bool(setting("tie_word_embeddings", True)), dtype=dtype)
    except ValueError as e:
        raise ValueError(f"{context}: {e}") from e


def to_hf_gpt2(gpt: GPT) -> Tuple[Dict[str, np.ndarray], dict]:
    """Return (tensors under GPT2LMHeadModel's names and layouts, its config) for a plain ``gpt``.

    Conv1D weights are transposed to (in, out); a tied head writes no ``lm_head.weight``; ``bias=False`` writes
    zero biases (GPT-2 always has them), which compute the same.
    """
    context = "to_hf_gpt2"
    if not isinstance(gpt, GPT):
        raise TypeError(f"{context}: expected a mpidist.models.GPT (got {type(gpt).__name__})")
    return _hf_tensors(gpt.state_dict(), gpt.config, context), hf_gpt2_config(gpt)


def _hf_tensors(state, config: GPTConfig, context) -> Dict[str, np.ndarray]:
    """Return the unsplit state ``state`` of a GPT of ``config`` under GPT-2's names and layouts."""
    table = _name_table(config)
    expected = {ours: shape for ours, _, _, shape in table}
    missing = [name for name in expected
               if name not in state and not (config.bias is False and name.endswith(".bias"))]
    unexpected = [name for name in state if name not in expected]
    wrong = [f"{name}: {tuple(state[name].shape)} (config: {expected[name]})" for name in expected
             if name in state and tuple(state[name].shape) != expected[name]]
    if missing or unexpected or wrong:
        raise ValueError(f"{context}: the model is not a plain GPT of its config (missing: {missing[:8]}, "
                         f"unexpected: {unexpected[:8]}, shapes: {wrong[:8]}); pass a parallel model's wrapper "
                         f"(or the model and comm=) to save_hf_gpt2, which gathers its unsplit state")
    dtype = np.dtype(config.dtype)
    tensors = {}
    for ours, hf, transposed, shape in table:
        array = to_numpy(state[ours]) if ours in state else np.zeros(shape, dtype=dtype)
        tensors[hf] = np.ascontiguousarray(array.T if transposed else array)
    return tensors


def _config_of(model, config, context) -> GPTConfig:
    """Return the GPTConfig of ``model``: its own for a GPT, else ``config`` (a wrapper does not know it)."""
    if config is None and isinstance(model, GPT):
        _gpt2_shaped(model.config)
        return model.config
    if not isinstance(config, GPTConfig):
        raise TypeError(f"{context}: pass config=, the GPTConfig of the model, with a {type(model).__name__} "
                        f"(only a GPT itself knows its config; got config={config!r})")
    _gpt2_shaped(config)   # before any collective: every rank refuses alike
    if isinstance(model, GPT) and dataclasses.asdict(model.config) != dataclasses.asdict(config):
        raise ValueError(f"{context}: config= {config} is not the GPT's own config {model.config}")
    return config


def save_hf_gpt2(model, directory, comm=None, *, rank=0, config: Optional[GPTConfig] = None) -> None:
    """Write a GPT at any layout as a Hugging Face GPT-2 checkpoint: ``directory/model.safetensors`` and ``config.json``.

    ``model``: a ``GPT`` (plain or tensor-parallel) or a wrapper of one (DDP, FSDP, Pipeline of its stages, a mesh
    of them); a wrapper needs ``config=``, the GPT's config. Its unsplit state streams to ``rank`` of ``comm``
    (default: the layout's own communicator; see ``mpidist.full_state_dict``), which writes; collective over
    ``comm``, and a failure raises on every rank. ``transformers.GPT2LMHeadModel.from_pretrained(directory)`` loads
    it with no missing or unexpected keys.
    """
    context = "save_hf_gpt2"
    if not isinstance(model, (Module, Wrapper)):
        raise TypeError(f"{context}: expected a mpidist.models.GPT or a parallel wrapper of one "
                        f"(got {type(model).__name__})")
    config = _config_of(model, config, context)
    # A GPT's LayerNorms share one eps; a wrapper's modules are its own business, and a GPT built from a
    # config uses LayerNorm's default.
    eps = _layer_norm_eps(model, context) if isinstance(model, GPT) else _DEFAULT_EPS
    state, comm = gather_state(model, layout_comm(model, comm), rank=rank, context=context)

    def write():
        tensors = _hf_tensors(state, config, context)
        # transformers refuses a safetensors file whose header does not name a framework it knows; the bytes are
        # framework-free, and "pt" is what its own save_pretrained writes.
        save_safetensors(tensors, os.path.join(os.fspath(directory), WEIGHTS_NAME), config=_hf_config(config, eps),
                         metadata={"format": "pt"})

    on_rank(comm, rank, write, context)


def load_hf_gpt2(directory, model=None, comm=None, *, rank=0, config: Optional[GPTConfig] = None):
    """Return the GPT stored in a GPT-2 checkpoint directory (``config.json`` + ``model.safetensors``).

    Names with and without the ``transformer.`` prefix are read, and the causal-mask buffers of older files are
    skipped. A setting we cannot reproduce, a missing, unexpected or misshapen tensor, or a tied
    ``lm_head.weight`` that differs from the token embedding raises ValueError naming it.

    With ``model`` (a GPT or a wrapper of one at any layout; a wrapper needs ``config=``), ``rank`` of ``comm``
    (default: the layout's own communicator) reads the checkpoint and ``load_full_state_dict`` scatters it into
    ``model``, which is returned; the checkpoint's shape (layers, heads, widths, vocabulary, tied head) must be
    ``model``'s. Collective over ``comm`` then, and a failure raises on every rank.
    """
    if model is None:
        return _read_hf_gpt2(directory)[0]
    context = f"load_hf_gpt2: {os.fspath(directory)}"
    if not isinstance(model, (Module, Wrapper)):
        raise TypeError(f"{context}: model must be a mpidist.models.GPT or a parallel wrapper of one "
                        f"(got {type(model).__name__})")
    config = _config_of(model, config, context)
    comm = layout_comm(model, comm)

    def read():
        gpt, hf_config = _read_hf_gpt2(directory)
        differ = [f"{name} {getattr(hf_config, name)} (model: {getattr(config, name)})" for name in _SHAPE_FIELDS
                  if getattr(hf_config, name) != getattr(config, name)]
        if differ:
            raise ValueError(f"{context}: the checkpoint is not of the model's shape ({'; '.join(differ)})")
        return gpt.state_dict()

    state = on_rank(comm, rank, read, context)
    load_full_state_dict(model, state, comm, rank=rank, context=context)
    return model


def _read_hf_gpt2(directory) -> Tuple[GPT, GPTConfig]:
    directory = os.fspath(directory)
    context = f"load_hf_gpt2: {directory}"
    config_file, weights_file = os.path.join(directory, CONFIG_NAME), os.path.join(directory, WEIGHTS_NAME)
    for path in (config_file, weights_file):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{context}: no {os.path.basename(path)} in the directory ({path})")
    try:
        with open(config_file, encoding="utf-8") as f:
            hf = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{context}: {CONFIG_NAME} is not JSON ({e})") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{context}: {CONFIG_NAME} is not a JSON object (got {type(hf).__name__})")
    tensors = _strip_prefix(read_safetensors(weights_file, context), context)
    dtypes = sorted({str(a.dtype) for a in tensors.values()})
    if len(dtypes) != 1 or np.dtype(dtypes[0]).kind != "f":
        raise ValueError(f"{context}: tensors must share one floating-point dtype (found {dtypes})")
    config = gpt_config_from_hf(hf, dtype=dtypes[0], context=context)
    # The initial weights are all overwritten: a private generator leaves the caller's random stream alone.
    gpt = GPT(config, rng=np.random.default_rng(0))
    eps = _layer_norm_eps(gpt, context)
    hf_eps = hf.get("layer_norm_epsilon", 1e-5)
    if isinstance(hf_eps, bool) or hf_eps != eps:
        raise ValueError(f"{context}: layer_norm_epsilon {hf_eps!r} is not this GPT's LayerNorm eps ({eps})")
    gpt.load_state_dict(_from_hf(tensors, config, context))
    return gpt, config


def _strip_prefix(tensors, context):
    """Return ``tensors`` named as in GPT2LMHeadModel (``transformer.`` prefix), whichever form the file used."""
    named = {}
    for name, array in tensors.items():
        bare = name[len("transformer."):] if name.startswith("transformer.") else name
        parts = bare.split(".", 2)
        if len(parts) == 3 and parts[0] == "h" and parts[2] in _MASK_BUFFERS:
            continue
        full = name if name == "lm_head.weight" else f"transformer.{bare}"
        if full in named:
            raise ValueError(f"{context}: tensor {bare!r} is stored twice (with and without 'transformer.')")
        named[full] = array
    return named


def _from_hf(tensors, config, context):
    table = _name_table(config)
    expected = {hf for _, hf, _, _ in table}
    lm_head = tensors.get("lm_head.weight") if config.tie_weights else None
    missing = [hf for hf in expected if hf not in tensors]
    unexpected = [name for name in tensors if name not in expected and name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{context}: tensors do not match a GPT-2 of this config (missing: {missing[:8]}, "
                         f"unexpected: {unexpected[:8]})")
    ours = {}
    wrong = []
    for name, hf, transposed, shape in table:
        array = tensors[hf]
        hf_shape = shape[::-1] if transposed else shape
        if tuple(array.shape) != hf_shape:
            wrong.append(f"{hf}: {tuple(array.shape)} (config: {hf_shape})")
            continue
        ours[name] = np.ascontiguousarray(array.T) if transposed else array
    if wrong:
        raise ValueError(f"{context}: tensors have the wrong shape ({'; '.join(wrong[:8])})")
    if lm_head is not None and not np.array_equal(lm_head, ours["embed.wte.weight"]):
        raise ValueError(f"{context}: lm_head.weight differs from transformer.wte.weight although "
                         f"tie_word_embeddings is true (max |difference|: "
                         f"{_max_difference(lm_head, ours['embed.wte.weight'])})")
    return ours


def _max_difference(a, b):
    if a.shape != b.shape:
        return f"shapes {a.shape} and {b.shape}"
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)), initial=0.0))
