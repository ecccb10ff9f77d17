"""The layer rules of pyproject.toml's [tool.importlinter] contracts hold, and bite.

The parts live in top-level folders that install as kvfs.<part> (package-dir),
which import-linter cannot see through an editable install; so each run lints a
mirror of the installed tree made of symlinks to the real files. The mirror also
lets a test plant one bad import and see the contract break.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINT = pathlib.Path(sys.executable).with_name("lint-imports")


@pytest.fixture
def tree(tmp_path) -> pathlib.Path:
    """A copy of the installed package layout (kvfs/, kvfs/engine/, ...) as symlinks."""
    pyproject = ROOT / "pyproject.toml"
    folders = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in folders.items():
        dst = tmp_path.joinpath(*package.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for source in (ROOT / folder).glob("*.py"):
            (dst / source.name).symlink_to(source)
    (tmp_path / "pyproject.toml").symlink_to(pyproject)
    return tmp_path


def lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache", "--no-logo", "pyproject.toml"], cwd=tree, capture_output=True,
                          text=True, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}, timeout=120)


def plant(tree: pathlib.Path, module: str, line: str) -> None:
    """Replaces the symlink of `module` (e.g. 'kvfs/keys.py') by a copy with `line` appended."""
    path = tree / module
    text = path.read_text()
    path.unlink()
    path.write_text(text + "\n" + line + "\n")


def test_the_tree_keeps_every_contract(tree):
    result = lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module,line", [
    ("kvfs/keys.py", "import kvfs.client"),                       # the core imports a part
    ("kvfs/errors.py", "from kvfs.cli import launcher"),           # the core imports an app
    ("kvfs/metaserver/state.py", "import kvfs.chunkserver.store"),  # a server imports another server
    ("kvfs/chunkserver/store.py", "import kvfs.client"),           # a server imports the client
    ("kvfs/client/restore.py", "import kvfs.engine"),              # the client imports the engine
    ("kvfs/engine/cache.py", "import kvfs.metaserver.state"),      # the engine goes around the client
])
def test_a_bad_import_breaks_a_contract(tree, module, line):
    plant(tree, module, line)
    result = lint(tree)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout
    assert line.split()[1].split(".")[-1] in result.stdout  # the report names what was imported


def test_a_new_core_module_must_be_placed_in_a_layer(tree):
    (tree / "kvfs" / "planner.py").write_text("import kvfs.engine\n")
    result = lint(tree)
    assert result.returncode != 0
    assert "kvfs.planner" in result.stdout + result.stderr
