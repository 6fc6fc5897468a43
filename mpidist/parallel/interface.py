"""The one interface every parallel wrapper answers, and ``LocalModule``, which lets a plain module answer it.

Checkpoints, elastic states, gradient clipping and full-model gathers read a wrapper only through ``Wrapper``:
which parameters of the unsplit model this rank holds and where their elements lie (``placed_parameters()``),
its buffers, the communicators it talks over, and how to reduce, clip and detach. Nothing outside a wrapper's
package needs to know which wrapper it holds (``isinstance(obj, Wrapper)``, or ``as_wrapper(obj)`` for a module).

Glossary:
- unsplit model: the model as one process would build it; its ``named_parameters()`` names are the global names
  every layout shares (a checkpoint saved at one layout loads at another by them).
- placement: where a parameter's elements lie across ranks (``mpidist.nn.placement``): None (whole here),
  ``Replicate`` (every rank of a communicator holds the same values), ``Shard`` (a block of the global tensor),
  ``FlatShard`` (a flat range of such a block inside a flat buffer several parameters share: FSDP's shards).
  A data-parallel replica is not a placement: DDP's ranks all hold the same layout.
- mesh: the ``mpidist.DeviceMesh`` of the ranks the layout spans, its dimensions those the wrapper works over;
  ``mesh.comm`` holds them all. DDP: one dimension, its data-parallel ranks ("dp"; tensor-parallel ranks live
  in the placements). FSDP: "shard" (full_shard, shard_grad_op), "replicate" (no_shard), or ("replicate",
  "shard") under hybrid sharding. Pipeline: "pp", with "dp" (and "tp") when built from such a mesh. A
  tensor-parallel module: "tp", its placements' communicator. A plain module: no dimension, ``mesh.comm`` None
  (this process alone); likewise a Pipeline given its pipeline and data-parallel communicators apart has mesh
  dimensions ("dp", "pp") but no communicator holding them all.
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Tuple

from ..comm import check_comm
from ..comm.agree import raise_if_any
from ..comm.mesh import DeviceMesh
from ..nn.module import Module, Parameter
from ..nn.placement import FlatShard, Replicate, placement_of
from ..nn.utils import GradParts, clip_coefficient, clip_grad_norm_

__all__ = ["Wrapper", "PlacedParameter", "LocalModule", "as_wrapper", "placement_comms", "mesh_of", "refuse_mesh"]


@dataclass(frozen=True, eq=False)
class PlacedParameter:
    """One parameter of the unsplit model as this rank holds it: its name there, the local Parameter, its placement."""

    name: str                     # the unsplit model's named_parameters() name
    parameter: Parameter          # the local storage the optimizer steps
    placement: Any                # None | Replicate | Shard | FlatShard (mpidist.nn.placement)
    stage: Optional[int] = None   # the pipeline stage holding it (None: no pipeline)
    primary: bool = True          # False: a further copy of a tied weight (a norm counts it 0 times)
    # A FlatShard placement (FSDP) names the part of ``parameter`` that is this parameter's: its ``offset`` and
    # ``count`` elements of the flat shard, which several PlacedParameters share (one per parameter of the
    # unit; a parameter lies contiguously in its unit's flat buffer, so one rank holds at most one piece of it).
    # Every rank lists every parameter; ``count`` 0 where its shard holds none of it.


def placement_comms(placed):
    """Return the communicators the placements of ``placed`` span, each once, in first-seen order."""
    comms = []
    for p in placed:
        comm = getattr(p.placement, "comm", None)
        if comm is not None and not any(comm is c for c in comms):
            comms.append(comm)
    return tuple(comms)


def mesh_of(comm_or_mesh, context, name):
    """Return ``comm_or_mesh`` if it is a DeviceMesh, else the 1-D mesh of that communicator, dimension ``name``."""
    if isinstance(comm_or_mesh, DeviceMesh):
        return comm_or_mesh
    check_comm(context, comm_or_mesh)
    return DeviceMesh.from_comm(comm_or_mesh, name)


def refuse_mesh(mesh, problem, context):
    """Raise ValueError on every rank of ``mesh.comm`` if ``problem`` (why its dimensions do not fit) is set.

    Collective over ``mesh.comm``; a mesh without one (``DeviceMesh.from_dimensions``) raises where it is set.
    """
    if problem and mesh.comm is None:
        raise ValueError(f"{context}: {problem}")
    if mesh.comm is not None:
        raise_if_any(mesh.comm, problem, context)


def dimensions(mesh):
    """Return "dp=2, tp=2" for a mesh of those dimensions ("no dimension" for none)."""
    return ", ".join(f"{name}={n}" for name, n in zip(mesh.names, mesh.shape)) or "no dimension"


class Wrapper(abc.ABC):
    """What every parallel wrapper answers: all that checkpoint, elastic, clipping and full-model gathers read.

    A subclass sets ``mesh`` and implements the abstract methods; ``parameters``, ``clip_grad_norm_`` and
    ``memory_stats`` are written once here from ``placed_parameters()`` and ``grad_norm_comms()``.
    """

    mesh: DeviceMesh

    @abc.abstractmethod
    def placed_parameters(self) -> Tuple[PlacedParameter, ...]:
        """Return every parameter this rank holds, in the unsplit model's order."""

    @abc.abstractmethod
    def named_buffers_global(self) -> Iterator[Tuple[str, Any]]:
        """Yield (unsplit name, array) for every buffer this rank holds."""

    @abc.abstractmethod
    def communicators(self) -> Tuple:
        """Return the communicators this wrapper made and talks over besides ``mesh.comm`` (elastic revokes them)."""

    @abc.abstractmethod
    def grad_norm_comms(self) -> Tuple:
        """Return the communicators whose ranks hold disjoint gradient parts, in one order on every rank."""

    @abc.abstractmethod
    def no_sync(self):
        """Return a context in which gradients accumulate locally; the next synchronizing backward reduces them."""

    @abc.abstractmethod
    def sync_gradients(self) -> None:
        """Reduce the gradients accumulated under ``no_sync`` now (blocking, collective)."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Detach from the module (hooks) without communicating, e.g. before wrapping it again."""

    # -- written once ---------------------------------------------------------------------------------
    def parameters(self):
        """Yield each local Parameter once (what the optimizer steps), in ``placed_parameters()`` order."""
        seen = set()
        for p in self.placed_parameters():
            if id(p.parameter) not in seen:
                seen.add(id(p.parameter))
                yield p.parameter

    def grad_parts(self) -> GradParts:
        """Return this rank's gradients with their weights in a global norm (a replicated one counts 1/n per rank,
        a non-primary copy not at all; a FlatShard contributes its piece of the flat shard) and
        ``grad_norm_comms()``."""
        grads, weights, seen = [], [], set()
        for p in self.placed_parameters():
            grad = p.parameter.grad
            if not p.primary or grad is None or id(p.parameter) in seen:
                continue
            where = p.placement
            if isinstance(where, FlatShard):  # its piece of a flat shard (a view: clipping scales it in place)
                if where.count:
                    grads.append(grad.reshape(-1)[where.offset:where.offset + where.count])
                    weights.append(_norm_weight(where.block))
                continue
            seen.add(id(p.parameter))
            grads.append(grad)
            weights.append(_norm_weight(where))
        return GradParts(grads, weights, self.grad_norm_comms())

    def clip_grad_norm_(self, max_norm, norm_type=2.0, error_if_nonfinite=False) -> float:
        """Clip all gradients to one global norm ``max_norm``; return the norm before (equal on every rank).

        Call after backward (after ``sync_gradients`` when accumulating under ``no_sync``): the norm is that of
        the unsplit model's gradients, each counted once whatever the layout.
        """
        parts = self.grad_parts()
        total = clip_grad_norm_(parts, max_norm, norm_type, None, error_if_nonfinite)
        # Non-primary copies of a tied weight hold the same gradient as the primary: scale them alike.
        scale = clip_coefficient(total, max_norm)
        if scale < 1.0:
            placed = self.placed_parameters()
            # Each Parameter once: one object may be listed as several copies (a tied weight in two chunks of an
            # interleaved pipeline rank), or as the primary the clip above already scaled.
            scaled = {id(p.parameter) for p in placed if p.primary}
            for p in placed:
                if not p.primary and p.parameter.grad is not None and id(p.parameter) not in scaled:
                    scaled.add(id(p.parameter))
                    p.parameter.grad *= scale
        return total

    def memory_stats(self, optimizer=None) -> dict:
        """Return this rank's bytes: parameters, gradients held now, ``optimizer``'s state for them, their sum.

        Keys: param_bytes, grad_bytes, optimizer_state_bytes, persistent_bytes and peak_bytes (the persistent
        bytes: a wrapper without transient buffers of its own peaks at them).
        """
        params = list(self.parameters())
        optimizer_bytes = optimizer_state_bytes(optimizer, params, f"{type(self).__name__}.memory_stats")
        param_bytes = sum(int(p.data.nbytes) for p in params)
        grad_bytes = sum(int(p.grad.nbytes) for p in params if p.grad is not None)
        persistent = param_bytes + grad_bytes + optimizer_bytes
        return {"param_bytes": param_bytes, "grad_bytes": grad_bytes, "optimizer_state_bytes": optimizer_bytes,
                "persistent_bytes": persistent, "peak_bytes": persistent}


def optimizer_state_bytes(optimizer, params, context):
    """Return the bytes of ``optimizer``'s state for ``params`` (0 without an optimizer); raise if it holds none."""
    if optimizer is None:
        return 0
    mine = {id(p) for p in params}
    if hasattr(optimizer, "flat_pieces"):   # it steps flat shards of the parameters (ZeroRedundancyOptimizer)
        if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"{context}: {type(optimizer).__name__} holds none of this wrapper's parameters; "
                             f"build it on wrapper.parameters()")
        held = [i for i in range(len(optimizer.params))
                if any(id(piece.param) in mine for piece in optimizer.flat_pieces(i))]   # (none: a shard of nothing)
        return sum(int(v.nbytes) for i in held for v in optimizer.state.get(i, {}).values() if hasattr(v, "nbytes"))
    held = [i for i, p in enumerate(optimizer.params) if id(p) in mine]
    if not held:
        raise ValueError(f"{context}: {type(optimizer).__name__} holds none of this wrapper's parameters; "
                         f"build it on wrapper.parameters()")
    return sum(int(v.nbytes) for i in held for v in optimizer.state.get(i, {}).values() if hasattr(v, "nbytes"))


class WholeModuleWrapper(Wrapper):
    """A wrapper whose rank holds every parameter of ``self.module`` (whole, or as its tensor-parallel slice)."""

    def placed_parameters(self):
        """Return the module's parameters under their names, with their (tensor-parallel) placements."""
        return tuple(PlacedParameter(name, p, placement_of(p)) for name, p in self.module.named_parameters())

    def named_buffers_global(self):
        """Yield the module's buffers (every rank holds all of them)."""
        return self.module.named_buffers()

    def communicators(self):
        """Return () : the wrapper makes no communicator of its own."""
        return ()

    def grad_norm_comms(self):
        """Return the communicators of the parameters' placements (tensor parallel), in the module's order."""
        return placement_comms(self.placed_parameters())


def _norm_weight(placement):
    """Return how often one rank's copy of a gradient under ``placement`` counts in a norm's sum."""
    return 1.0 / placement.comm.Get_size() if isinstance(placement, Replicate) else 1.0


class LocalModule(WholeModuleWrapper):
    """A module not wrapped for data or pipeline parallelism: plain, or tensor-parallel through its placements.

    Its gradients are final after backward (tensor-parallel layers reduce inside backward), so ``no_sync`` and
    ``sync_gradients`` do nothing and there is nothing to ``remove``. ``mesh``: the one communicator its
    placements span as dimension "tp" (a tensor-parallel model's), or no dimension and ``mesh.comm`` None for a
    plain module.
    """

    def __init__(self, module):
        if not isinstance(module, Module):
            raise TypeError(f"LocalModule: module must be an mpidist.nn.Module (got {type(module).__name__})")
        self.module = module
        comms = placement_comms(self.placed_parameters())
        if len(comms) > 1:
            raise ValueError(f"LocalModule: the parameters of {type(module).__name__} are placed over "
                             f"{len(comms)} different communicators (sizes {[c.Get_size() for c in comms]}); "
                             f"a module without a wrapper may span one")
        self.mesh = DeviceMesh.from_comm(comms[0], "tp") if comms else DeviceMesh.from_dimensions({})

    def no_sync(self):
        return contextlib.nullcontext()

    def sync_gradients(self):
        pass

    def remove(self):
        pass


def as_wrapper(obj) -> Wrapper:
    """Return ``obj`` if it is a Wrapper, ``LocalModule(obj)`` for an nn.Module; else raise TypeError naming it."""
    if isinstance(obj, Wrapper):
        return obj
    if isinstance(obj, Module):
        return LocalModule(obj)
    raise TypeError(f"as_wrapper: expected a parallel wrapper (DDP) or an mpidist.nn.Module, "
                    f"got {type(obj).__name__}")
