"""Initializers that can draw any box of a parameter alone: its values are a function of (seed, name) only.

Glossary:
- initializer: ``Uniform(low, high)``, ``Normal(mean, std)`` or ``Constant(value)``: what a layer asks for a
  parameter, recorded (a deferred parameter keeps it until it is materialized) or drawn at once (eager).
- eager draw (``Initializer.eager``): the sequential draw from a numpy Generator that layers always made
  (``mpidist.manual_seed`` and ``rng=`` keep their meaning: the n-th layer built gets the n-th draws).
- keyed draw (``Initializer.draw``): element ``i`` (row-major flat index in the global tensor) of the parameter
  named ``name`` is computed from outputs ``k*i .. k*i + k - 1`` of a Philox counter-based generator keyed by
  ``(seed, name)`` (k = 1 for uniform, 2 for normal: Box-Muller). Philox jumps to any output without producing
  the ones before, so a rank draws only the boxes it holds, and every box equals the same elements of the whole
  draw bit for bit: the values do not depend on the layout.

Bitwise equality needs numpy's elementwise ``log``/``cos``/``sqrt`` to give one result per input wherever the
element sits in an array (true of numpy's loops); ranks on different CPU kinds could differ in the last bit
of a normal draw.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Initializer", "Uniform", "Normal", "Constant", "FromSource", "philox_key", "draw_box", "draw_box_into"]

_TWO_PI = 2.0 * math.pi
_PIECE = 1 << 13  # elements drawn at once: 64 KiB of float64 uniforms per Philox output an element uses


def philox_key(seed, name):
    """Return the 128-bit Philox key of the parameter ``name`` under ``seed`` (a hash of both)."""
    digest = hashlib.blake2b(f"{int(seed)}\0{name}".encode(), digest_size=16).digest()
    return int.from_bytes(digest, "little")


def _uniform_run(key, start, count, per_element):
    """Return (count, per_element) uniforms in [0, 1) of elements ``start .. start + count`` (keyed draw)."""
    first = start * per_element
    bits = np.random.Philox(key=key, counter=first // 4)  # Philox makes 4 outputs per counter value
    gen = np.random.Generator(bits)
    if first % 4:
        bits.random_raw(first % 4)
    # Generator.random is (output >> 11) * 2**-53, one output per number: the same number wherever it starts.
    return gen.random(count * per_element).reshape(count, per_element)


def _runs(offsets, sizes, shape):
    """Yield ``(flat start, length, index into the box)``: the box as contiguous runs of the row-major tensor."""
    ndim = len(shape)
    # The trailing dimensions the box spans whole are contiguous with the first partial one before them.
    k = ndim - 1
    while k > 0 and sizes[k] == shape[k] and offsets[k] == 0:
        k -= 1
    length = math.prod(sizes[k:]) if ndim else 1
    strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
    outer = sizes[:k]
    for index in np.ndindex(*outer):
        start = sum((offsets[d] + index[d]) * strides[d] for d in range(k)) + (offsets[k] * strides[k] if ndim else 0)
        yield start, length, index


@dataclass(frozen=True)
class Initializer:
    """Base: how a parameter's initial values are made (subclasses say which distribution)."""

    per_element = 1  # Philox outputs each element uses in a keyed draw

    def eager(self, rng, shape, dtype):
        """Return a new array of ``shape`` drawn from ``rng`` in order (what layers always did)."""
        raise NotImplementedError

    def fill(self, out, seed, name, offsets, shape):
        """Write into ``out`` the box at ``offsets`` (sizes ``out.shape``) of parameter ``name`` of ``shape``."""
        self.draw_into(out, philox_key(seed, name), offsets, shape)

    def from_uniforms(self, u):
        """Return float64 values from ``u`` (n, per_element) uniforms in [0, 1)."""
        raise NotImplementedError

    def draw(self, key, offsets, sizes, shape, dtype):
        """Return the box ``offsets``/``sizes`` of the keyed draw of a ``shape`` tensor, as ``dtype``."""
        out = np.empty(tuple(sizes), dtype=dtype)
        self.draw_into(out, key, offsets, shape)
        return out

    def draw_into(self, out, key, offsets, shape):
        """Write into ``out`` (shaped like the box) the box at ``offsets`` of the keyed draw of a ``shape`` tensor.

        Drawn in pieces of at most ``_PIECE`` elements, so the float64 work arrays stay small whatever the box.
        """
        sizes = tuple(out.shape)
        if not out.size:
            return
        contiguous = out.flags.c_contiguous
        rows = out.reshape(-1) if contiguous else np.empty(out.size, dtype=out.dtype)
        at = 0
        for start, length, _ in _runs(tuple(offsets), sizes, tuple(shape)):
            for lo in range(0, length, _PIECE):
                n = min(_PIECE, length - lo)
                rows[at + lo:at + lo + n] = self.from_uniforms(_uniform_run(key, start + lo, n, self.per_element))
            at += length
        if not contiguous:
            out[...] = rows.reshape(sizes)


@dataclass(frozen=True)
class Uniform(Initializer):
    """Uniform on [low, high)."""

    low: float
    high: float

    def eager(self, rng, shape, dtype):
        return rng.uniform(self.low, self.high, shape).astype(dtype)

    def from_uniforms(self, u):
        return self.low + (self.high - self.low) * u[:, 0]


@dataclass(frozen=True)
class Normal(Initializer):
    """Normal with ``mean`` and standard deviation ``std``."""

    mean: float = 0.0
    std: float = 1.0
    per_element = 2

    def eager(self, rng, shape, dtype):
        z = rng.standard_normal(shape) * self.std
        return (z + self.mean if self.mean else z).astype(dtype)

    def from_uniforms(self, u):
        # Box-Muller, the cosine half: 1 - u lies in (0, 1], so the log is finite.
        z = np.sqrt(-2.0 * np.log1p(-u[:, 0])) * np.cos(_TWO_PI * u[:, 1])
        z = z * self.std
        return z + self.mean if self.mean else z


@dataclass(frozen=True)
class Constant(Initializer):
    """Every element ``value`` (a norm's ones, a bias's zeros)."""

    value: float = 0.0
    per_element = 0

    def eager(self, rng, shape, dtype):
        return np.full(shape, self.value, dtype=dtype)

    def draw(self, key, offsets, sizes, shape, dtype):
        return np.full(tuple(sizes), self.value, dtype=dtype)

    def draw_into(self, out, key, offsets, shape):
        out[...] = self.value


@dataclass(frozen=True, eq=False)
class FromSource(Initializer):
    """The values stored under ``key`` in ``source`` (a checkpoint or safetensors file, ``mpidist.sources``).

    A source answers ``read(key, offsets, sizes, out)``: a rank materializing its part reads only its boxes.
    """

    source: object
    key: str

    def eager(self, rng, shape, dtype):
        out = np.empty(shape, dtype=dtype)
        self.source.read(self.key, (0,) * len(shape), tuple(shape), out)
        return out

    def fill(self, out, seed, name, offsets, shape):
        if out.flags.c_contiguous:
            self.source.read(self.key, tuple(offsets), tuple(out.shape), out)
        else:  # a column block of a tensor-parallel slice: read it whole, then place it
            box = np.empty(out.shape, dtype=out.dtype)
            self.source.read(self.key, tuple(offsets), tuple(out.shape), box)
            out[...] = box


def draw_box_into(init, seed, name, out, offsets, shape):
    """Write into ``out`` the box at ``offsets`` (sizes: ``out.shape``) of parameter ``name`` under ``seed``."""
    init.fill(out, seed, name, offsets, shape)


def draw_box(init, seed, name, offsets, sizes, shape, dtype):
    """Return the box ``offsets``/``sizes`` of parameter ``name`` (global ``shape``) under ``seed``, as ``dtype``."""
    return init.draw(philox_key(seed, name), offsets, sizes, shape, dtype)
