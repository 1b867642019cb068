"""The layout shows the architecture: the root holds the scripts a user runs, model.py and a few packages; the
imports flow one way (no cycle, type-only imports included; no module importing a script; no package importing one
on a floor above its own); parsing train.py's options loads no model code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("train", "eval", "data", "profile_memory", "verify_chunked_loss", "gpu_check", "inspect_nsa", "train_npt")
PACKAGES = ("modeling", "nsa", "npt", "training", "storage", "text", "evaluation", "examples")
ROOT_ENTRIES = {*(f"{s}.py" for s in SCRIPTS), "model.py", *PACKAGES, "configs", "benchmarks", "tests", "docs",
                "README.md", "pyproject.toml", ".ci", ".gitignore"}


# The floors, lowest first: a module imports only from its own floor or those below (a package on one floor never
# imports another package of that floor).
FLOORS = (("modeling",), ("model",), ("nsa", "npt"), ("storage",), ("text",), ("evaluation",), ("training",),
          ("examples",), SCRIPTS)


def project_modules() -> dict[str, Path]:
    """Every module of the project but the tests and benchmarks: dotted name -> file."""
    files = [ROOT / "model.py", *(ROOT / f"{s}.py" for s in SCRIPTS),
             *(p for package in PACKAGES for p in sorted((ROOT / package).glob("*.py")))]
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}


def imports(path: Path, modules: dict[str, Path], top_level_only: bool) -> set[str]:
    """The project modules `path` imports (`from pkg import mod` imports pkg.mod); only those run at import time
    when `top_level_only` (not inside a function, nor under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
    return {name for name in found if name in modules}


def test_the_root_holds_the_scripts_model_and_packages():
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    entries = {name.split("/")[0] for name in tracked}
    assert entries <= ROOT_ENTRIES, sorted(entries - ROOT_ENTRIES)
    assert all((ROOT / package / "__init__.py").is_file() for package in PACKAGES)


def test_no_module_imports_a_script_and_imports_have_no_cycle():
    modules = project_modules()
    for name, path in modules.items():
        scripts = imports(path, modules, top_level_only=False) & set(SCRIPTS)
        assert not scripts, f"{name} imports the script(s) {sorted(scripts)}: move what it needs into a package"
    graph = {name: imports(path, modules, top_level_only=False) - {name} for name, path in modules.items()}
    done: set[str] = set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            raise AssertionError(f"import cycle: {' -> '.join([*stack[stack.index(name):], name])}")
        if name in done:
            return
        for dependency in sorted(graph[name]):
            visit(dependency, [*stack, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.slow
def test_option_parsing_loads_no_model_code():
    code = ("import sys; from training.options import parse_config; parse_config(['--finetune', 'lora']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('model', 'nsa', 'npt', 'storage') "
            "and m not in ('storage', 'storage.manifest', 'storage.places') "  # checksums, places: no model code
            "or m in ('modeling.attention', 'training.modes', 'training.lora')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]", proc.stdout


def test_no_package_imports_one_on_a_floor_above_its_own():
    floor = {unit: level for level, units in enumerate(FLOORS) for unit in units}
    modules = project_modules()
    against = [f"{name} -> {dependency}" for name, path in modules.items()
               for dependency in sorted(imports(path, modules, top_level_only=False))
               if name.split(".")[0] != dependency.split(".")[0]
               and floor[dependency.split(".")[0]] >= floor[name.split(".")[0]]]
    assert not against, f"imports against the floors {FLOORS}: {against}"
