"""Standard JSON for the files mpidist writes, and reading it back with nothing that executes.

Every mpidist file format is JSON plus raw bytes; none holds pickle or anything else that runs code when
read, so a file from another user, cluster or object store is data, never a program. Python's ``json``
writes ``NaN``/``Infinity``, which standard JSON (and most readers outside Python) refuse; ``encode`` gives
those, and the values JSON has no type for, a tagged form instead:

- a non-finite float: ``{"__float__": "nan"}`` (or ``"inf"``, ``"-inf"``);
- a numpy array or numpy scalar of a number or bool dtype: ``{"__array__": {"dtype": "<f8", "shape": [2, 3],
  "data": <base64 of the raw row-major bytes>}}`` (a scalar has ``"shape": null``), read back with
  ``numpy.frombuffer``, never through an object dtype;
- a dict whose single key is one of those tags (user data that happens to look like one):
  ``{"__dict__": {...}}``, so that reading it back does not turn it into a float or an array.

As with ``json``, tuples become lists and dict keys that are numbers, bools or None become their JSON text.
Anything else (other objects) is refused with a ``TypeError`` naming where it is, instead of being stored in
a form that runs code.
"""

import base64
import binascii
import json
import math

import ml_dtypes
import numpy as np

__all__ = ["encode", "decode", "dumps", "loads", "check_dtype", "dtype_code"]

FLOAT, ARRAY, DICT = "__float__", "__array__", "__dict__"
TAGS = (FLOAT, ARRAY, DICT)
_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
_KINDS = "biufc"  # bool, signed, unsigned, float, complex: raw bytes with no Python object behind them
# bfloat16 (ml_dtypes; mixed precision) is raw bytes too, but numpy's dtype string for it ("<V2") names no number:
# it is written by name.
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def dtype_code(dtype):
    """Return the string a file stores for number dtype ``dtype``: numpy's ``dtype.str``, or "bfloat16"."""
    return "bfloat16" if dtype == _BFLOAT16 else dtype.str


def check_dtype(dtype):
    """Return ``numpy.dtype(dtype)`` if it is a plain number or bool dtype (or "bfloat16"); raise ValueError otherwise."""
    if dtype == "bfloat16":
        return _BFLOAT16
    try:
        found = np.dtype(dtype) if isinstance(dtype, str) else None
    except (TypeError, ValueError):
        found = None
    if found is None or found.kind not in _KINDS or found.fields is not None or found.subdtype is not None:
        raise ValueError(f"must name a number or bool dtype such as '<f8' (got {dtype!r:.60})")
    return found


def encode(value, where="value"):
    """Return ``value`` as data ``json.dumps(..., allow_nan=False)`` accepts, with the tags of the module's docstring."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {FLOAT: "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"}
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        if (array.dtype.kind not in _KINDS and array.dtype != _BFLOAT16) or array.dtype.fields is not None:
            raise TypeError(f"{where}: a numpy value of dtype {array.dtype} cannot be stored as data")
        raw = np.ascontiguousarray(array).tobytes()
        return {ARRAY: {"dtype": dtype_code(array.dtype), "shape": None if isinstance(value, np.generic) else list(array.shape),
                        "data": base64.b64encode(raw).decode("ascii")}}
    if isinstance(value, (list, tuple)):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, (str, int, float, bool)) and k is not None]
        if bad:
            raise TypeError(f"{where}: a dict key of type {type(bad[0]).__name__} cannot be stored as JSON")
        out = {_key(k): encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {DICT: out} if len(out) == 1 and next(iter(out)) in TAGS else out
    raise TypeError(f"{where}: a {type(value).__name__} cannot be stored as JSON data (store numbers, strings, "
                    f"lists, dicts and numpy arrays)")


def _key(key):
    """Return ``key`` as ``json`` writes a dict key: strings as they are, numbers, bools and None as their JSON text."""
    return key if isinstance(key, str) else json.dumps(key)


def decode(data, where="value"):
    """Return the values ``encode`` turned into ``data``; raise ValueError naming where a tag is malformed."""
    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, body), = data.items()
        if tag == FLOAT:
            if body not in _FLOATS:
                raise ValueError(f"{where}: {FLOAT} must be 'nan', 'inf' or '-inf' (got {body!r:.60})")
            return _FLOATS[body]
        if tag == ARRAY:
            return _array(body, where)
        if tag == DICT:
            if not isinstance(body, dict):
                raise ValueError(f"{where}: {DICT} must hold an object (got {type(body).__name__})")
            return {k: decode(v, f"{where}[{k!r}]") for k, v in body.items()}
    return {k: decode(v, f"{where}[{k!r}]") for k, v in data.items()}


def _array(body, where):
    if not isinstance(body, dict) or set(body) != {"dtype", "shape", "data"}:
        raise ValueError(f"{where}: {ARRAY} must hold exactly dtype, shape and data")
    try:
        dtype = check_dtype(body["dtype"])
    except ValueError as exc:
        raise ValueError(f"{where}: {ARRAY} dtype {exc}") from None
    shape = body["shape"]
    if shape is not None and (not isinstance(shape, list) or
                              any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape)):
        raise ValueError(f"{where}: {ARRAY} shape must be a list of ints >= 0 or null (got {shape!r:.60})")
    try:
        raw = base64.b64decode(body["data"], validate=True) if isinstance(body["data"], str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        raise ValueError(f"{where}: {ARRAY} data must be base64 text")
    count = 1 if shape is None else math.prod(shape)
    if len(raw) != count * dtype.itemsize:
        raise ValueError(f"{where}: {ARRAY} holds {len(raw)} bytes, its shape {shape} of {dtype} needs "
                         f"{count * dtype.itemsize}")
    array = np.frombuffer(raw, dtype=dtype).copy()
    return array[0] if shape is None else array.reshape(shape)


def dumps(value, **kwargs):
    """Return standard JSON text of ``value`` (``encode``d; ``NaN`` and ``Infinity`` never appear)."""
    return json.dumps(encode(value), allow_nan=False, **kwargs)


def _refuse_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r:.80} in one object")
        seen[key] = value
    return seen


def loads(text):
    """Return the JSON data in ``text`` (tags left as they are: see ``decode``); an object naming a key twice is an error.

    ``json`` would keep the last of two equal keys, so an edited file could hide a value behind another.
    ``NaN``/``Infinity`` literals that older versions wrote are read as floats.
    """
    return json.loads(text, object_pairs_hook=_refuse_duplicates)
