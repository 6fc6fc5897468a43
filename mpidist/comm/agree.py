"""Agreement on failure: an error found on some ranks is raised on every rank, with every rank's reason.

Without it, a rank that rejects its input raises while the others enter the next collective and wait
for it forever (or, under MPI, match a later message and compute garbage). Every check that can fail
on some ranks only ends in one of these two calls, so all ranks leave together with the same message.

- ``raise_if_any(comm, problem, context)``: each rank passes its problem (a string, or None);
  if any rank has one, every rank raises ``error`` naming each rank's problem.
- ``agreed(comm, fn, context)``: run ``fn()``; if it raised on any rank, every rank raises an error of
  the first failing rank's type (``fallback`` when that type cannot be rebuilt from a message),
  chained to the local exception where there is one.
- ``check_same(comm, items, context)``: every rank must pass equal lists (a model's parameter names,
  shapes and dtypes; a schedule's settings); otherwise every rank raises naming the first difference
  and which ranks hold which value.
- ``describe_ranks(values)`` and ``name_ranks(ranks)``: the one way every message names ranks
  ("rank 0: x; ranks 2,3: y", "ranks 0,2"), for errors whose values were gathered some other way.

Both cost one small object allgather, so they belong at set-up and on error paths, not in hot loops.
"""

import hashlib

__all__ = ["raise_if_any", "agreed", "check_same", "describe_ranks", "name_ranks"]


def name_ranks(ranks):
    """Return "rank 3" or "ranks 0,2" for ``ranks`` (any order, repeats named once)."""
    ranks = sorted(set(ranks))
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def describe_ranks(values, joiner=": "):
    """Return "rank 0: x; ranks 2,3: y" for ``values`` (one per rank, None where a rank has none).

    Ranks with equal values are named together, in order of their first rank; ``joiner`` goes between
    the ranks and their value (" called " gives "ranks 1,2 called Bcast(...)").
    """
    grouped = {}
    for rank, value in enumerate(values):
        if value is not None:  # not a falsy test: a count of 0 is a value
            grouped.setdefault(value, []).append(rank)
    return "; ".join(f"{name_ranks(ranks)}{joiner}{value}" for value, ranks in grouped.items())


def _message(context, problems):
    return f"{context}: {describe_ranks(problems)}" if context else describe_ranks(problems)


def raise_if_any(comm, problem, context, error=ValueError):
    """Raise ``error`` on every rank of ``comm`` if any rank's ``problem`` is set (collective)."""
    if problem and context and str(problem).startswith(f"{context}: "):
        problem = str(problem)[len(context) + 2:]  # said once, in front of all ranks' problems
    problems = comm.allgather(str(problem) if problem else None)
    if any(problems):
        raise error(_message(context, problems))


def _rebuild(cls, message, fallback):
    try:
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(message)
    except Exception:  # noqa: BLE001 - an exception type whose constructor wants more than a message
        pass
    return fallback(message)


def agreed(comm, fn, context, fallback=RuntimeError):
    """Return ``fn()``; if it raised on any rank of ``comm``, raise on every rank naming each rank's error.

    ``KeyboardInterrupt``/``SystemExit`` on this rank are not caught (a signal is not a disagreement).
    """
    error, result = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised there
        error = exc
    reports = comm.allgather(None if error is None else (type(error), f"{type(error).__name__}: {error}"))
    failed = [report for report in reports if report]
    if not failed:
        return result
    problems = [report[1] if report else None for report in reports]
    raise _rebuild(failed[0][0], _message(context, problems), fallback) from error


def _digest(items):
    return hashlib.blake2b(repr(list(items)).encode(), digest_size=8).hexdigest()


def check_same(comm, items, context, what="item", error=ValueError):
    """Raise ``error`` on every rank unless every rank of ``comm`` passed an equal ``items`` list (collective).

    Only a digest travels when the ranks agree; on a difference the lists are gathered and the message
    names the first index where some rank differs from rank 0, with every rank's value there.
    """
    items = list(items)
    digests = comm.allgather(_digest(items))
    if len(set(digests)) == 1:
        return
    everyone = comm.allgather(items)
    lengths = [len(x) for x in everyone]
    first = next((i for i in range(max(lengths))
                  if len({repr(x[i]) if i < len(x) else "<missing>" for x in everyone}) > 1), None)
    if first is None:  # equal reprs, different digests cannot happen; report the lengths all the same
        first = min(lengths)
    values = [repr(x[first]) if first < len(x) else f"<none: only {len(x)} {what}s>" for x in everyone]
    count = "" if len(set(lengths)) == 1 else f" ({what} counts: {describe_ranks(lengths)})"
    raise error(f"{context}: ranks disagree at {what} {first}{count}: {describe_ranks(values)}")
