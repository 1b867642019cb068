"""The code an export carries when transformers has no class for its architecture (NSA): storage/remote_model.py as
modeling_longctx.py, and every project module it imports, found by following the imports (model.py, modeling/,
nsa/). Each file is the module's own source with its imports of the project made relative, and its dotted name
flattened (nsa.layer -> nsa_layer.py), as transformers' trust_remote_code loader wants them: so the export runs the
project's code, never a copy kept in step by hand.

    files = remote_code_files()          # {"modeling_longctx.py": source, "model.py": ..., "nsa_layer.py": ...}
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENTRY = "storage.remote_model"
MODELING_FILE = "modeling_longctx.py"
AUTO_MAP = {"AutoConfig": "modeling_longctx.LongctxConfig", "AutoModel": "modeling_longctx.LongctxModel",
            "AutoModelForCausalLM": "modeling_longctx.LongctxForCausalLM",
            "AutoModelForSequenceClassification": "modeling_longctx.LongctxForSequenceClassification"}
PROJECT = tuple(sorted(path.stem for path in ROOT.iterdir()  # the project's top-level modules and packages
                       if (path.suffix == ".py" or (path / "__init__.py").is_file()) and not path.name.startswith(".")))
_FROM = re.compile(r"^(\s*)from\s+((?:" + "|".join(PROJECT) + r")(?:\.\w+)*)\s+import\b", re.MULTILINE)


def source_file(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def flat_name(module: str) -> str:
    """The file a project module becomes in the export: nsa.layer -> nsa_layer.py (the entry: MODELING_FILE)."""
    return MODELING_FILE if module == ENTRY else module.replace(".", "_") + ".py"


def project_imports(module: str) -> list[str]:
    """The project modules `module` imports (anywhere in it, lazily too). ValueError for an import form the export
    cannot make relative (`import nsa.x`, or `from nsa import x` where x is a module)."""
    tree = ast.parse(source_file(module).read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] in PROJECT for a in node.names):
            raise ValueError(f"{module}: `import {node.names[0].name}` cannot travel in an export; use "
                             "`from package.module import name`")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in PROJECT:
            if not source_file(node.module).is_file():
                raise ValueError(f"{module}: `from {node.module} import ...` names a package, not a module; import "
                                 "from the module itself so that an export can carry it")
            found.append(node.module)
    return found


def remote_code_files() -> dict[str, str]:
    """{file name: source} of the export's code: ENTRY and every project module it reaches."""
    files, modules, todo = {}, {}, [ENTRY]
    while todo:
        module = todo.pop()
        name = flat_name(module)
        if modules.get(name, module) != module:
            raise ValueError(f"{module} and {modules[name]} would both travel as {name}: rename one")
        if name in files:
            continue
        modules[name] = module
        todo += project_imports(module)
        text = _FROM.sub(lambda m: f"{m[1]}from .{flat_name(m[2]).removesuffix('.py')} import",
                         source_file(module).read_text())
        absolute = [node.module for node in ast.walk(ast.parse(text))
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] in PROJECT]
        if absolute:  # an import the rewrite did not reach (not at the start of its line)
            raise ValueError(f"{module}: `from {absolute[0]} import` could not be made relative for an export")
        files[name] = text
    return files
