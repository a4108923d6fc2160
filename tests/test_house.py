"""The house rules, checked on the code as it stands (static: nothing of the project runs).

- One import name: code imports `retropipe.<package>`, never a bare `data`, `training`, ...;
  installed, `import data` fails and `import retropipe` works; pyproject lists every package.
- Dependencies point one way: launch → training, retrieval → data. training never imports
  retrieval; data imports nothing else of RetroPipe; only the adapters import deepspeed and ray.
  Inside training: models ← run ← pipeline, evaluation (each imports only rooms before it).
- Rooms stay small: at most 12 modules a folder, 400 lines a file, 50 lines a function in
  training/, retrieval/ and launch/.
"""

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("data", "retrieval", "training", "launch")
CODE = [p for folder in (*PACKAGES, "bench", "tests") for p in sorted((ROOT / folder).rglob("*.py"))]


def imports(path: Path) -> list[str]:
    """Every module a file imports (absolute names), at any depth of the file."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def room(path: Path) -> str:
    """"data", "retrieval", "launch", or "training.<subpackage>" of a package file."""
    rel = path.relative_to(ROOT).parts
    return f"training.{rel[1]}" if rel[0] == "training" and len(rel) > 2 else rel[0]


def test_code_imports_retropipe_never_a_bare_package():
    bare = [(str(p.relative_to(ROOT)), name) for p in CODE for name in imports(p)
            if name.split(".")[0] in PACKAGES]
    assert not bare, bare


def test_installed_retropipe_is_one_top_level_name(tmp_path):
    """From outside the checkout (as a user's notebook folder with its own data.py)."""
    (tmp_path / "data.py").write_text("X = 1\n")
    code = ("import retropipe, retropipe.data.store, retropipe.training.models.gpt2, retropipe.launch.config\n"
            "import importlib.util as u\n"
            "print(all(u.find_spec(n) is None for n in ('training', 'retrieval', 'launch')))\n"
            "import data; print(data.X)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert out.returncode == 0 and out.stdout.split() == ["True", "1"], out.stdout + out.stderr


def test_pyproject_lists_every_package_folder():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {".".join(("retropipe", *p.parent.relative_to(ROOT).parts)) for pkg in PACKAGES
               for p in (ROOT / pkg).rglob("__init__.py")}
    assert set(setuptools["packages"]) == folders
    assert setuptools["package-dir"] == {f"retropipe.{pkg}": pkg for pkg in PACKAGES}


# room → the rooms of RetroPipe it may import (itself always)
MAY_IMPORT = {
    "data": set(),
    "retrieval": {"data"},
    "training.models": {"data"},
    "training.run": {"data", "training.models"},
    "training.pipeline": {"data", "training.models", "training.run"},
    "training.evaluation": {"data", "training.models"},
    "training": {"data"},
    "launch": {"data", "retrieval", "training", "training.models", "training.run", "training.pipeline",
               "training.evaluation"},
}
ADAPTERS = {"deepspeed": {"training/pipeline/deepspeed_engine.py", "training/pipeline/deepspeed_private.py",
                          "training/pipeline/elastic_state.py"},
            "ray": {"launch/ray_utils.py", "retrieval/ray_embed.py"}}


def test_dependencies_point_one_way():
    wrong = []
    for path in (p for p in CODE if p.relative_to(ROOT).parts[0] in PACKAGES):
        mine = room(path)
        for name in imports(path):
            parts = name.split(".")
            if parts[0] == "retropipe" and len(parts) > 1:
                theirs = f"training.{parts[2]}" if parts[1] == "training" and len(parts) > 2 else parts[1]
                if theirs != mine and theirs not in MAY_IMPORT[mine]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
            elif parts[0] in ADAPTERS and str(path.relative_to(ROOT)) not in ADAPTERS[parts[0]]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name} (only {sorted(ADAPTERS[parts[0]])} may)")
    assert not wrong, "\n".join(wrong)


def test_folders_files_and_functions_stay_small():
    big = []
    for folder in {p.parent for p in CODE}:
        modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > 12:
            big.append(f"{folder.relative_to(ROOT)}/: {len(modules)} modules")
    for path in CODE:
        lines = len(path.read_text().splitlines())
        if lines > 400:
            big.append(f"{path.relative_to(ROOT)}: {lines} lines")
        if path.relative_to(ROOT).parts[0] in ("training", "retrieval", "launch"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                    big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: "
                               f"{node.end_lineno - node.lineno + 1} lines")
    assert not big, "\n".join(big)


# Each error a user may see → the one module that defines it: the package that raises it (data's
# errors.py holds the ones every package raises and data's own).
ERROR_HOMES = {
    "ConfigError": "data/errors.py", "DataError": "data/errors.py", "StageError": "data/errors.py",
    "TokenizerError": "data/errors.py", "RetrievalError": "retrieval/__init__.py",
    "ModelFormatError": "training/models/__init__.py", "HFFormatError": "training/models/hf_interop.py",
    "TrainingError": "training/run/__init__.py", "ClusterError": "launch/ray_utils.py",
}


@pytest.mark.parametrize("name", sorted(ERROR_HOMES))
def test_errors_are_defined_once(name):
    defined = [str(p.relative_to(ROOT)) for p in CODE if f"class {name}(" in p.read_text()]
    assert defined == [ERROR_HOMES[name]], defined
