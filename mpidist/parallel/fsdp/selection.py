"""Unit selection: which modules form each unit, and which unit owns each parameter.

A parameter belongs to the first unit (in the order given) whose modules hold it. A parameter that
modules of several units hold (tied weights: an embedding reused by the output head) is owned there
and *used* by the others: a unit gathers the units it uses together with itself.
"""

from collections import OrderedDict

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
    """Return, per group, ``(owned [(name, param)], used group indices)``; raise if a parameter is in no unit.

    Owned parameters keep the wrapped module's ``named_parameters()`` order; ``used`` lists the other
    units whose parameters this unit's modules hold (tied weights).
    """
    names = OrderedDict((id(p), n) for n, p in module.named_parameters())
    owner = {}
    held = []
    for index, (_, mods) in enumerate(groups):
        ids = []
        for m in mods:
            for _, p in m.named_parameters():
                owner.setdefault(id(p), index)
                ids.append(id(p))
        held.append(ids)
    uncovered = [n for pid, n in names.items() if pid not in owner]
    if uncovered:
        raise ValueError(f"FSDP: units do not cover parameters {uncovered}; add their modules to a unit "
                         f"(units: {[label for label, _ in groups]})")
    out = []
    for index, (label, _) in enumerate(groups):
        params = [(n, p) for n, p in module.named_parameters() if owner[id(p)] == index]
        dtypes = sorted({str(p.data.dtype) for _, p in params})
        if len(dtypes) > 1:
            raise ValueError(f"FSDP: unit {index} ({label!r}) mixes dtypes {dtypes}; a flat parameter has one dtype, "
                             f"so put parameters of different dtypes in different units")
        if len({get_array_module(p.data).__name__ for _, p in params}) > 1:
            raise ValueError(f"FSDP: unit {index} ({label!r}) mixes numpy and device arrays")
        used = sorted({owner[pid] for pid in held[index]} - {index})
        out.append((params, used))
    return out
