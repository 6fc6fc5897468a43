"""The environment: every ``MPIDIST_*`` variable mpidist reads, parsed and typed in one place.

Glossary:
- variable: one ``MPIDIST_*`` name with its kind, what it does and what 0 means where it is a number
  (``VARIABLES``; docs/environment.md is the same table for readers).
- kind: how its text becomes a value: ``bool`` (1/0, true/false, yes/no, on/off, any case), ``duration``
  (seconds, a finite number >= 0), ``int`` and ``number`` (with a lower bound), ``choice`` (one of a few
  names), ``directory`` (a path mpidist writes into; ``writable`` probes it where the job starts using it),
  ``text`` (kept as given, or parsed by its owner through ``get(name, parse=...)``).
- unset: a variable that is absent or empty; ``get`` returns None and the reader applies its default.

``check()`` runs when mpidist is imported: a bad value of any variable ends the program there, naming the
variable and the value, instead of changing behaviour silently (``MPIDIST_DEBUG=false`` once turned debug
mode on; ``MPIDIST_COLLECTIVE_TIMEOUT=nan`` switched the watchdog off) or failing deep inside a job.
Readers call ``get`` where they use a value (not a copy taken at import), so a variable set later in the
process (a test, ``mpidist sim --cpus``) still applies. This module imports nothing of mpidist: every layer
may read the environment through it.
"""

import dataclasses
import math
import os
import tempfile

__all__ = ["ConfigError", "Variable", "VARIABLES", "GPU_PATHS", "TORCH_PROGRESS_MODES", "get", "check", "table",
           "writable_problem"]

GPU_PATHS = ("self", "cuda_aware", "nccl", "ipc", "hierarchical", "staged")  # mpidist.gpu.PATHS
TORCH_PROGRESS_MODES = ("auto", "thread", "poll", "inline")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class ConfigError(ValueError):
    """An ``MPIDIST_*`` variable holds a value mpidist cannot use."""


@dataclasses.dataclass(frozen=True)
class Variable:
    """One ``MPIDIST_*`` variable: how to read it, and the line the docs table shows for it."""

    name: str
    kind: str                 # bool, duration, int, number, choice, directory, text
    default: str              # what applies while it is unset (for the docs; the reader holds the value)
    meaning: str
    zero: str = ""            # what 0 means (numbers that accept 0)
    minimum: float = 0        # int and number: the smallest value accepted
    above: bool = False       # number: the value must be above ``minimum``, not equal to it
    choices: tuple = ()
    fallback: str = ""        # a variable whose value applies while this one is unset (a former name)
    accepts: str = ""         # text: what its owner's parser accepts (for the docs)


def _variables(*variables):
    return {v.name: v for v in variables}


VARIABLES = _variables(
    Variable("MPIDIST_DEBUG", "bool", "off", "debug mode: ranks compare the fingerprint of every collective "
             "before it moves data (`guard.configure(desync=)`)"),
    Variable("MPIDIST_CHECK_BYTES", "int", "33554432 (32 MiB)", "outside debug mode, collectives whose message has "
             "at least this many bytes compare fingerprints", zero="never outside debug mode"),
    Variable("MPIDIST_COLLECTIVE_TIMEOUT", "duration", "300", "seconds a collective or receive may stay in flight "
             "before the watchdog reports and aborts the job (`init(collective_timeout=)`)", zero="no limit",
             fallback="MPIDIST_WATCHDOG_TIMEOUT"),
    Variable("MPIDIST_WATCHDOG_TIMEOUT", "duration", "300", "former name of `MPIDIST_COLLECTIVE_TIMEOUT` (which "
             "wins when both are set)", zero="no limit"),
    Variable("MPIDIST_CHECKPOINT_TIMEOUT", "duration", "1800", "the limit inside `checkpoint.save`/`load` (phase "
             "`checkpoint`, `init(checkpoint_timeout=)`)", zero="no limit"),
    Variable("MPIDIST_DESYNC_GRACE", "duration", "1", "seconds a rank waits in a desync check before its watchdog "
             "asks the others whether they went ahead without one", zero="ask at the watchdog's next poll (0.2 s)"),
    Variable("MPIDIST_FLIGHT_SIZE", "int", "2000", "calls the flight recorder keeps per process", minimum=16),
    Variable("MPIDIST_FLIGHT_DIR", "directory", "./mpidist-flight", "where flight records are written; probed "
             "when the watchdog starts (`init()`), an unwritable one fails the start on every rank"),
    Variable("MPIDIST_TRACE", "directory", "unset: no trace", "record every rank's timeline into this directory "
             "(written at exit); probed when the program imports mpidist"),
    Variable("MPIDIST_TRACE_DEPTH", "int", "1", "with `MPIDIST_TRACE`: time modules down to this many calls deep",
             zero="only the outermost module"),
    Variable("MPIDIST_TRACE_LIMIT", "int", "1048576", "with `MPIDIST_TRACE`: events kept per rank (the last ones)",
             minimum=1),
    Variable("MPIDIST_SIM_TIMEOUT", "duration", "unset: no limit", "seconds one wait of a simulated rank may last "
             "(`simulate(timeout=)`)", zero="no limit"),
    Variable("MPIDIST_SIM_CPUS", "text", "unset: any CPU", "bind simulated ranks' threads to these CPUs (`mpidist sim "
             "--cpus`); parsed when a simulated world starts", accepts="CPUs: `0`, `0,2`, `0-3`"),
    Variable("MPIDIST_GPU_PATH", "choice", "unset: the first path that works", "force the path of device-array "
             "collectives", choices=GPU_PATHS),
    Variable("MPIDIST_CUDA_AWARE", "bool", "unset: ask MPI, then a self-test", "whether MPI takes device buffers "
             "(overrides the probe)"),
    Variable("MPIDIST_GPU_CHUNK_MB", "number", "4", "MiB per pipelined chunk of the staged GPU path", above=True),
    Variable("MPIDIST_TORCH_PROGRESS", "choice", "auto", "how the torch backend completes its work objects",
             choices=TORCH_PROGRESS_MODES),
    Variable("MPIDIST_TORCH_ABORTABLE", "bool", "off", "the torch backend's progress thread waits so that "
             "`abort()` can end a wait inside MPI (about 20% slower DDP steps)"),
    Variable("MPIDIST_STORE_HOST", "text", "unset: loopback on one node, else rank 0's host name", "address of "
             "rank 0's node for the torch backend's store", accepts="a host name or address"),
    Variable("MPIDIST_FAULT", "text", "unset: none", "inject failures into elastic training (docs/elastic.md); "
             "parsed when `Elastic` starts", accepts="`rank=R,step=S[,how=H][,at=A]`, several joined by `;`"),
    Variable("MPIDIST_FAULT_STAMP", "text", "unset", "file an injected fault writes its time to before failing",
             accepts="a file path"),
)


def _wrong(variable, expected, text):
    return ConfigError(f"{variable.name}: expected {expected} (got {text!r})")


def _parse(variable, text):
    kind = variable.kind
    if kind == "bool":
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise _wrong(variable, "1/0, true/false, yes/no or on/off", text)
    if kind in ("duration", "number"):
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low = variable.minimum
        if kind == "duration":
            expected = f"a finite number of seconds >= 0 (0: {variable.zero})"
        else:
            expected = f"a finite number {'>' if variable.above else '>='} {low:g}"
        if not math.isfinite(value) or value < low or (variable.above and value == low):
            raise _wrong(variable, expected, text)
        return value
    if kind == "int":
        try:
            value = int(text.strip())
        except ValueError:
            value = None
        if value is None or value < variable.minimum:
            zero = f" (0: {variable.zero})" if variable.zero and variable.minimum <= 0 else ""
            raise _wrong(variable, f"an integer >= {variable.minimum:g}{zero}", text)
        return value
    if kind == "choice":
        word = text.strip()
        if word not in variable.choices:
            raise _wrong(variable, f"one of {', '.join(variable.choices)}", text)
        return word
    return text  # directory, text


def get(name, environ=None, parse=None):
    """Return the typed value of variable ``name`` in ``environ`` (default ``os.environ``); None while unset.

    ``parse``: the owner's parser of a ``text`` variable; a ValueError it raises becomes a ConfigError
    naming the variable and the value. A variable with a former name falls back to it while unset.
    """
    variable = VARIABLES.get(name)
    if variable is None:
        raise KeyError(f"mpidist.config: unknown variable {name!r} (known: {', '.join(VARIABLES)})")
    env = os.environ if environ is None else environ
    text = env.get(name)
    if text is None or text.strip() == "":
        return get(variable.fallback, env) if variable.fallback else None
    value = _parse(variable, text)
    if parse is not None:
        try:
            value = parse(value)
        except ValueError as exc:
            message = str(exc)  # an owner's message that names the variable already is kept as it is
            if not message.startswith(f"{name}:"):
                message = f"{name}: {message}" + ("" if repr(text) in message else f" (got {text!r})")
            raise ConfigError(message) from None
    return value


def check(environ=None):
    """Raise ConfigError naming every variable of ``environ`` (default ``os.environ``) whose value is bad.

    Directories are not probed here (see ``writable_problem``) and owner-parsed texts are parsed by their
    owner when it starts (``MPIDIST_FAULT``, ``MPIDIST_SIM_CPUS``).
    """
    problems = []
    for name in VARIABLES:
        try:
            get(name, environ)
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems) + " (the MPIDIST_* variables are listed in docs/environment.md)")


def _accepts(variable):
    kind = variable.kind
    if kind == "bool":
        return "1/0, true/false, yes/no, on/off"
    if kind == "duration":
        return "seconds, finite, >= 0"
    if kind == "int":
        return f"integer >= {variable.minimum:g}"
    if kind == "number":
        return f"number {'>' if variable.above else '>='} {variable.minimum:g}"
    if kind == "choice":
        return ", ".join(f"`{c}`" for c in variable.choices)
    return "a directory it can write to" if kind == "directory" else variable.accepts or "text"


def table():
    """Return the Markdown table of every variable (docs/environment.md holds it; a test keeps them equal)."""
    rows = ["| variable | accepts | unset | what it does | 0 means |", "|---|---|---|---|---|"]
    numeric = ("duration", "int", "number")
    rows += [f"| `{v.name}` | {_accepts(v)} | {v.default} | {v.meaning} | "
             f"{(v.zero or 'refused') if v.kind in numeric else ''} |" for v in VARIABLES.values()]
    return "\n".join(rows)


def writable_problem(path):
    """Return why files cannot be written under directory ``path`` (created later if missing), or None.

    Probes by writing and removing a file in ``path``, or where it does not exist yet, in its nearest
    existing parent (which will hold it): permissions alone miss read-only file systems and root.
    """
    here = os.path.abspath(path)
    while not os.path.exists(here):
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    if not os.path.isdir(here):
        return f"{here} is not a directory"
    try:
        handle, probe = tempfile.mkstemp(prefix=".mpidist-probe-", dir=here)
        os.close(handle)
        os.remove(probe)
    except OSError as exc:
        return f"cannot create a file in {here}: {exc.strerror or exc}"
    return None
