"""The docs say what the code does: facts written in two places (setup.cfg and the docs, the Makefile and the
docs) must agree, so a change to one that forgets the other fails here."""

import ast
import configparser
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg


def test_readme_declares_the_python_setup_cfg_requires():
    minimum = re.fullmatch(r">=\s*(\d+\.\d+)", _setup_cfg()["options"]["python_requires"].strip()).group(1)
    assert f"Python >= {minimum}" in (ROOT / "README.md").read_text()
    declared = tuple(map(int, minimum.split(".")))
    # The declared minimum is one the suite runs on (CI and the developers' machines run this interpreter) ...
    assert sys.version_info[:2] >= declared
    # ... and the code does not use what older Pythons lack: zip(strict=) is 3.10.
    uses_zip_strict = [str(path.relative_to(ROOT)) for folder in ("mpidist", "tests") for path in (ROOT / folder).rglob("*.py")
                       if any(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "zip"
                              and any(k.arg == "strict" for k in node.keywords)
                              for node in ast.walk(ast.parse(path.read_text())))]
    if uses_zip_strict:
        assert declared >= (3, 10), f"zip(strict=) needs Python 3.10 but setup.cfg declares {minimum}: {uses_zip_strict[:3]}"


def test_sim_tools_names_the_registered_pytest_plugin():
    entry = _setup_cfg()["options.entry_points"]["pytest11"].strip()  # "mpidist_sim = mpidist_pytest"
    name, module = (part.strip() for part in entry.split("="))
    text = (ROOT / "docs" / "sim_tools.md").read_text()
    assert f"`{name} = {module}`" in text


def test_the_plugin_imports_no_mpi_without_sim_world(tmp_path):
    """docs/sim_tools.md promises that an installed mpidist does not make every pytest run import MPI."""
    (tmp_path / "test_plain.py").write_text("def test_nothing():\n    pass\n")
    code = ("import sys, pytest; pytest.main(['-q', '-p', 'no:cacheprovider', sys.argv[1]]); "
            "print('plugin loaded:', 'mpidist_pytest' in sys.modules, 'MPI imported:', 'mpi4py.MPI' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120).stdout
    assert "1 passed" in out and "plugin loaded: True MPI imported: False" in out, out


def test_docs_describe_make_demo_as_the_makefile_runs_it():
    makefile = (ROOT / "Makefile").read_text()
    demo_recipe = makefile.split("\ndemo: venv\n", 1)[1].splitlines()[0]
    assert "examples/gpt.py" in demo_recipe
    for doc in ("README.md", "docs/cluster.md"):
        for line in (ROOT / doc).read_text().splitlines():
            if re.match(r"\s*make demo\s+#", line):
                assert "GPT" in line and "digits classifier with DDP" not in line.split("make demo-digits")[0], \
                    f"{doc}: {line.strip()}"


@pytest.mark.mpi_skip  # it starts its own 4 simulated ranks
def test_the_layout_doc_runs_as_written(tmp_path):
    """docs/layout.md's python blocks, in order, are one program on 4 simulated ranks: its asserts hold."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "layout.md").read_text(), re.S)
    assert len(blocks) == 7, len(blocks)
    program = tmp_path / "layout_doc.py"
    program.write_text("\n\n".join(blocks))
    result = subprocess.run([sys.executable, str(program)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
