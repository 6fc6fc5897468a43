"""The environment: every MPIDIST_* variable is parsed by mpidist.config, and a bad value is refused at start-up.

Each class of bad value (a boolean word, a duration that is not finite or below 0, an int or number out of its
bounds, an unknown choice, an owner-parsed text, an unwritable directory) is refused naming the variable and
the value: at import for values, where the job starts for directories (the trace at import, flight records
when ``init()`` starts the watchdog).
"""

import os
import re
import subprocess
import sys
import time

import pytest

import launcher
import mpidist
from mpidist import config, guard
from mpidist.config import ConfigError
from mpidist.guard import flight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def of_kind(kind):
    return [name for name, variable in config.VARIABLES.items() if variable.kind == kind]


def refused(name, text, expected):
    """Assert that ``name=text`` is refused with 'NAME: expected ... (got 'text')'."""
    with pytest.raises(ConfigError, match=re.escape(f"{name}: expected {expected}") + r".*" + re.escape(f"(got {text!r})")):
        config.get(name, {name: text})
    with pytest.raises(ConfigError, match=re.escape(f"{name}: expected")):
        config.check({name: text})


# -- values ------------------------------------------------------------------------------------------------
WORDS = {"1": True, "0": False, "true": True, "false": False, "yes": True, "no": False, "on": True, "off": False,
         "TRUE": True, "False": False, " Yes ": True, "OFF": False}


@pytest.mark.parametrize("name", of_kind("bool"))
def test_booleans_accept_the_documented_words_only(name):
    for text, value in WORDS.items():
        assert config.get(name, {name: text}) is value, (name, text)
    for text in ("2", "maybe", "y", "tru", "enable", "nan"):
        refused(name, text, "1/0, true/false, yes/no or on/off")
    assert config.get(name, {}) is None and config.get(name, {name: ""}) is None  # unset: the reader's default


def test_debug_false_leaves_debug_mode_off():
    assert guard.config.from_environment({"MPIDIST_DEBUG": "false"}).desync is False
    assert guard.config.from_environment({"MPIDIST_DEBUG": "off"}).desync is False
    assert guard.config.from_environment({"MPIDIST_DEBUG": "on"}).desync is True


@pytest.mark.parametrize("name", of_kind("duration"))
def test_durations_are_finite_seconds_not_below_zero(name):
    for text, value in (("0", 0.0), ("2.5", 2.5), (" 300 ", 300.0), ("1e3", 1000.0)):
        assert config.get(name, {name: text}) == value, (name, text)
    zero = config.VARIABLES[name].zero
    for text in ("nan", "NaN", "inf", "-inf", "1e999", "-1", "-0.5", "abc", "5s"):
        refused(name, text, f"a finite number of seconds >= 0 (0: {zero})")


def test_nan_cannot_switch_the_watchdog_off():
    with pytest.raises(ConfigError, match=r"MPIDIST_COLLECTIVE_TIMEOUT: expected .* \(got 'nan'\)"):
        guard.config.from_environment({"MPIDIST_COLLECTIVE_TIMEOUT": "nan"})
    with pytest.raises(ConfigError, match=r"MPIDIST_WATCHDOG_TIMEOUT: expected .* \(got 'nan'\)"):
        guard.config.from_environment({"MPIDIST_WATCHDOG_TIMEOUT": "nan"})
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"collective_timeout must be a finite number >= 0"):
            guard.Settings(collective_timeout=bad)
    # The former name applies while the new one is unset; the new one wins.
    assert guard.config.from_environment({"MPIDIST_WATCHDOG_TIMEOUT": "7"}).collective_timeout == 7
    both = {"MPIDIST_WATCHDOG_TIMEOUT": "7", "MPIDIST_COLLECTIVE_TIMEOUT": "0"}
    assert guard.config.from_environment(both).collective_timeout == 0  # 0: no limit


@pytest.mark.parametrize("name, good, bad", [
    ("MPIDIST_CHECK_BYTES", {"0": 0, "4096": 4096}, ("1.5", "-1", "1e6", "big")),
    ("MPIDIST_FLIGHT_SIZE", {"16": 16, "2000": 2000}, ("15", "0", "-3", "2000.0")),
    ("MPIDIST_TRACE_DEPTH", {"0": 0, "3": 3}, ("-1", "one")),
    ("MPIDIST_TRACE_LIMIT", {"1": 1, "1048576": 1 << 20}, ("0", "-5", "1e6")),
])
def test_integers_have_a_lower_bound(name, good, bad):
    for text, value in good.items():
        assert config.get(name, {name: text}) == value
    low = config.VARIABLES[name].minimum
    for text in bad:
        refused(name, text, f"an integer >= {low}")


def test_numbers_and_choices():
    assert config.get("MPIDIST_GPU_CHUNK_MB", {"MPIDIST_GPU_CHUNK_MB": "0.5"}) == 0.5
    for text in ("0", "-2", "nan", "inf", "lots"):
        refused("MPIDIST_GPU_CHUNK_MB", text, "a finite number > 0")
    for name, choices in (("MPIDIST_GPU_PATH", ("self", "cuda_aware", "nccl", "ipc", "hierarchical", "staged")),
                          ("MPIDIST_TORCH_PROGRESS", ("auto", "thread", "poll", "inline"))):
        for choice in choices:
            assert config.get(name, {name: choice}) == choice
        refused(name, "fast", f"one of {', '.join(choices)}")


def test_check_names_every_bad_variable_at_once():
    with pytest.raises(ConfigError) as info:
        config.check({"MPIDIST_DEBUG": "maybe", "MPIDIST_SIM_TIMEOUT": "abc", "MPIDIST_FLIGHT_SIZE": "2",
                      "MPIDIST_CHECKPOINT_TIMEOUT": "600"})
    text = str(info.value)
    assert "MPIDIST_DEBUG: expected" in text and "(got 'maybe')" in text, text
    assert "MPIDIST_SIM_TIMEOUT: expected" in text and "(got 'abc')" in text, text
    assert "MPIDIST_FLIGHT_SIZE: expected" in text and "(got '2')" in text, text
    assert "CHECKPOINT" not in text and "docs/environment.md" in text, text
    config.check({"MPIDIST_DEBUG": "yes", "MPIDIST_SIM_TIMEOUT": "0"})  # good values pass


@pytest.mark.mpi_skip
def test_a_bad_value_ends_the_program_when_it_imports_mpidist():
    def run(**env):
        return subprocess.run([sys.executable, "-c", "import mpidist; print('imported')"], capture_output=True,
                              text=True, timeout=120, env=launcher.env(**env))
    proc = run(MPIDIST_DEBUG="maybe", MPIDIST_COLLECTIVE_TIMEOUT="nan", MPIDIST_GPU_PATH="fast",
               MPIDIST_TORCH_PROGRESS="fast")
    assert proc.returncode != 0 and "imported" not in proc.stdout, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mpidist.config.ConfigError: MPIDIST_DEBUG: expected 1/0, true/false, yes/no or on/off "
                           "(got 'maybe'); MPIDIST_COLLECTIVE_TIMEOUT: expected a finite number of seconds >= 0 "
                           "(0: no limit) (got 'nan')"), last
    assert "MPIDIST_GPU_PATH: expected one of self," in last and "MPIDIST_TORCH_PROGRESS: expected one of auto," in last
    proc = run(MPIDIST_DEBUG="off", MPIDIST_COLLECTIVE_TIMEOUT="0")
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stdout + proc.stderr


# -- what 0 means, and the texts their owners parse ------------------------------------------------------------
@pytest.mark.mpi_skip
def test_a_zero_simulator_timeout_means_no_limit_and_a_bad_one_names_the_variable(monkeypatch):
    def body(comm):  # rank 0 waits 0.3 s for rank 1's message
        if comm.rank == 1:
            time.sleep(0.3)
            comm.send("late", dest=0)
            return None
        return comm.recv(source=1)

    monkeypatch.setenv("MPIDIST_SIM_TIMEOUT", "0")
    assert mpidist.simulate(2, body)[0] == "late"
    for text in ("-1", "abc", "nan"):
        monkeypatch.setenv("MPIDIST_SIM_TIMEOUT", text)
        with pytest.raises(ConfigError, match=rf"MPIDIST_SIM_TIMEOUT: expected .* \(got {text!r}\)"):
            mpidist.simulate(2, body)


@pytest.mark.mpi_skip
def test_owner_parsed_texts_name_the_variable(monkeypatch):
    monkeypatch.setenv("MPIDIST_SIM_CPUS", "abc")
    with pytest.raises(ConfigError, match=r"MPIDIST_SIM_CPUS: simulate: cpus must name CPUs like .*\(got 'abc'\)"):
        mpidist.simulate(2, lambda comm: None)
    monkeypatch.delenv("MPIDIST_SIM_CPUS")
    from mpidist import elastic
    with pytest.raises(ConfigError, match=r"MPIDIST_FAULT: step missing in 'rank=1'"):
        elastic.faults_from_env({"MPIDIST_FAULT": "rank=1"})
    assert elastic.faults_from_env({"MPIDIST_FAULT": "rank=1,step=2"}) == (elastic.Fault(1, 2),)


# -- directories ------------------------------------------------------------------------------------------------
def blocked(tmp_path):
    """Return a directory path no process can create: its parent is a regular file (root or not)."""
    (tmp_path / "file").write_text("")
    return str(tmp_path / "file" / "records")


def test_writable_problem_probes_the_directory_or_the_parent_that_will_hold_it(tmp_path):
    assert config.writable_problem(str(tmp_path)) is None
    assert config.writable_problem(str(tmp_path / "new" / "deeper")) is None
    assert os.listdir(tmp_path) == []  # probing creates nothing and leaves nothing
    assert config.writable_problem(blocked(tmp_path)) == f"{tmp_path / 'file'} is not a directory"


@pytest.mark.mpi_skip
def test_an_unwritable_trace_directory_ends_the_program_at_its_start(tmp_path):
    target = blocked(tmp_path)
    proc = subprocess.run([sys.executable, "-c", "import mpidist; print('ran')"], capture_output=True, text=True,
                          timeout=120, env=launcher.env(MPIDIST_TRACE=target))
    assert proc.returncode != 0 and "ran" not in proc.stdout, proc.stdout + proc.stderr
    assert (f"mpidist.config.ConfigError: MPIDIST_TRACE: cannot write the trace to {target!r} "
            f"({tmp_path / 'file'} is not a directory)") in proc.stderr, proc.stderr


@pytest.fixture
def flight_dir():
    """Restore the guard's flight directory after the test."""
    before = guard.settings.flight_dir
    yield
    guard.configure(flight_dir=before)


@pytest.mark.mpi_skip
def test_a_chosen_unwritable_flight_directory_fails_on_every_rank(tmp_path, flight_dir, monkeypatch):
    target = blocked(tmp_path)
    guard.configure(flight_dir=target)
    expected = rf"cannot write flight records to '{re.escape(target)}' \(.* is not a directory\)"
    with pytest.raises(ConfigError, match=rf"guard flight_dir: ranks 0,1,2: {expected}"):
        mpidist.simulate(3, flight.check_directory)
    monkeypatch.setenv("MPIDIST_FLIGHT_DIR", target)
    with pytest.raises(ConfigError, match=rf"MPIDIST_FLIGHT_DIR: ranks 0,1: {expected}"):
        mpidist.simulate(2, flight.check_directory)


@pytest.mark.mpi_skip
def test_an_unwritable_default_flight_directory_only_warns(tmp_path, flight_dir, monkeypatch):
    monkeypatch.delenv("MPIDIST_FLIGHT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mpidist-flight").write_text("")  # a file where the default directory would go
    guard.configure(flight_dir=guard.Settings().flight_dir)
    with pytest.warns(RuntimeWarning, match=r"flight records cannot be written to 'mpidist-flight' \(.*mpidist-flight "
                                            r"is not a directory\): .* set MPIDIST_FLIGHT_DIR"):
        mpidist.simulate(2, flight.check_directory)


@pytest.mark.mpi_skip
@launcher.needed
def test_an_unwritable_flight_directory_fails_the_start_of_an_mpi_job(tmp_path):
    target = blocked(tmp_path)
    job = tmp_path / "start.py"
    job.write_text("import mpidist\nmpidist.init()\nprint('started', flush=True)\n")
    proc = subprocess.run(launcher.mpiexec(2, sys.executable, str(job)), capture_output=True, text=True, timeout=120,
                          env=launcher.env(MPIDIST_FLIGHT_DIR=target), cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "started" not in out, out
    assert f"MPIDIST_FLIGHT_DIR: ranks 0,1: cannot write flight records to {target!r}" in out, out


# -- one place --------------------------------------------------------------------------------------------------
# Reads that only save and restore a value around a change, never interpreting it.
SAVED_AND_RESTORED = {("cli.py", "MPIDIST_SIM_CPUS")}


def test_every_variable_is_read_through_config_and_documented():
    package = os.path.join(ROOT, "mpidist")
    named, direct = set(), []
    for folder, _, files in os.walk(package):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, package)
            with open(path) as f:
                text = f.read()
            named.update(re.findall(r"MPIDIST_[A-Z0-9_]+", text))
            if relative == "config.py":
                continue
            for variable in re.findall(r"""(?:environ\.get|getenv|environ\[)\(?\s*["'](MPIDIST_[A-Z0-9_]+)""", text):
                if (relative, variable) not in SAVED_AND_RESTORED:
                    direct.append(f"{relative}: {variable}")
    assert not direct, f"read without mpidist.config: {direct}"
    assert named <= set(config.VARIABLES), sorted(named - set(config.VARIABLES))
    with open(os.path.join(ROOT, "docs", "environment.md")) as f:
        assert config.table() in f.read(), "docs/environment.md: paste mpidist.config.table() in place of its table"
