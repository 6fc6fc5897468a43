"""Unit selection: which modules form each unit, and which unit owns each parameter.

A parameter belongs to the first unit (in the order given) whose modules hold it. A parameter that
modules of several units hold (tied weights: an embedding reused by the output head) is owned there
and *used* by the others: a unit gathers the units it uses together with itself.

A unit's flat parameter is one optimizer Parameter, so it is all trainable or all frozen
(``requires_grad=False``): a frozen parameter inside a trainable flat parameter would get gradient storage,
take part in the reduce-scatter and move under weight decay. A unit whose modules hold both keeps the
trainable ones and uses a *frozen part*, a unit of their own labelled ``"<label> (frozen)"`` with no modules
of its own (gathered with the unit, as a tied weight's unit is).
"""

import numpy as np

from ...nn.module import Module, Sequential
from ...xp import get_array_module

__all__ = ["resolve_units", "assign_parameters"]


def resolve_units(module, units):
    """Return ``[(label, (module, ...)), ...]`` for the ``units`` argument, or raise naming the bad value."""
    sequential = isinstance(module, Sequential)
    children = list(module.named_children())
    if units is None:
        if not sequential:
            raise ValueError(f"FSDP: units=None splits a Sequential into one unit per child, but the module is a "
                             f"{type(module).__name__}; pass units=[submodules...] (or units=[module] for one unit)")
        return [(name, (child,)) for name, child in children]
    if isinstance(units, (int, np.integer)) and not isinstance(units, bool):
        if not sequential:
            raise ValueError(f"FSDP: a size threshold (units={units}) groups children of a Sequential, but the module "
                             f"is a {type(module).__name__}; pass units=[submodules...]")
        if units < 1:
            raise ValueError(f"FSDP: a size threshold must be >= 1 element (got units={units})")
        groups, current, numel = [], [], 0
        for name, child in children:
            current.append((name, child))
            numel += sum(int(p.data.size) for p in child.parameters())
            if numel >= units:
                groups.append(current)
                current, numel = [], 0
        if current:
            groups.append(current)
        return [("+".join(n for n, _ in g), tuple(c for _, c in g)) for g in groups]
    if not isinstance(units, (list, tuple)) or not units:
        raise TypeError(f"FSDP: units must be None, an int size threshold or a non-empty list (got {units!r})")

    path = {id(m): name for name, m in module.named_modules()}

    def one(item):
        if isinstance(item, Module):
            if id(item) not in path:
                raise ValueError(f"FSDP: unit module {type(item).__name__} is not part of the wrapped module")
            return path[id(item)], item
        if isinstance(item, (int, np.integer)) and not isinstance(item, bool):
            if not sequential:
                raise TypeError(f"FSDP: unit index {item} needs a Sequential module (got {type(module).__name__})")
            if not 0 <= item < len(children):
                raise ValueError(f"FSDP: unit index {item} out of range for a Sequential of {len(children)} children")
            return children[item]
        raise TypeError(f"FSDP: a unit item must be a Module, a child index or a list of those (got {item!r})")

    groups, seen = [], {}
    for index, entry in enumerate(units):
        items = [one(i) for i in (entry if isinstance(entry, (list, tuple)) else [entry])]
        if not items:
            raise ValueError(f"FSDP: unit {index} is empty")
        for name, m in items:
            if id(m) in seen:
                raise ValueError(f"FSDP: module {name or '<root>'!r} is listed in unit {seen[id(m)]} and unit {index}; "
                                 f"units must not overlap")
            seen[id(m)] = index
        groups.append(("+".join(name or "<root>" for name, _ in items), tuple(m for _, m in items)))
    # A unit module inside another unit's module would be gathered twice and hooked twice: refuse it.
    for index, (label, mods) in enumerate(groups):
        for m in mods:
            for inner_name, inner in m.named_modules():
                other = seen.get(id(inner))
                if inner is not m and other is not None:
                    raise ValueError(f"FSDP: unit {other} ({groups[other][0]!r}) lies inside unit {index} "
                                     f"({label!r}); units must not nest: list the inner modules' siblings instead")
    return groups


def assign_parameters(module, groups):
    """Return ``[(label, modules, owned [(name, param)], used unit indices)]``, one entry per unit.

    Owned parameters keep the wrapped module's ``named_parameters()`` order; ``used`` lists the other units
    whose parameters this unit's modules hold (tied weights, its frozen part). A group holding both trainable
    and frozen parameters becomes two units, the trainable one first (see the module's docstring). Raise if a
    parameter is in no unit, or a unit mixes dtypes or devices.
    """
    named = list(module.named_parameters())
    owner = {}
    held = []
    for index, (_, mods) in enumerate(groups):
        ids = []
        for m in mods:
            for _, p in m.named_parameters():
                owner.setdefault(id(p), index)
                ids.append(id(p))
        held.append(ids)
    uncovered = [n for n, p in named if id(p) not in owner]
    if uncovered:
        raise ValueError(f"FSDP: units do not cover parameters {uncovered}; add their modules to a unit "
                         f"(units: {[label for label, _ in groups]})")
    for index, (label, _) in enumerate(groups):
        params = [p for _, p in named if owner[id(p)] == index]
        dtypes = sorted({str(p.data.dtype) for p in params})
        if len(dtypes) > 1:
            raise ValueError(f"FSDP: unit {index} ({label!r}) mixes dtypes {dtypes}; a flat parameter has one dtype, "
                             f"so put parameters of different dtypes in different units")
        if len({get_array_module(p.data).__name__ for p in params}) > 1:
            raise ValueError(f"FSDP: unit {index} ({label!r}) mixes numpy and device arrays")
    # Each group's parameters, trainable first, then frozen: one unit per non-empty part (a group owning
    # nothing stays one unit: it may use others' parameters).
    parts = []
    for index, (label, mods) in enumerate(groups):
        params = [(n, p) for n, p in named if owner[id(p)] == index]
        trainable = [(n, p) for n, p in params if p.requires_grad]
        frozen = [(n, p) for n, p in params if not p.requires_grad]
        if trainable and frozen:
            parts += [(index, label, mods, trainable), (index, f"{label} (frozen)", (), frozen)]
        else:
            parts.append((index, label, mods, params))
    unit_of = {id(p): u for u, (_, _, _, params) in enumerate(parts) for _, p in params}
    out = []
    for u, (index, label, mods, params) in enumerate(parts):
        used = sorted({unit_of[pid] for pid in held[index]} - {u}) if mods else []
        out.append((label, mods, params, used))
    return out
