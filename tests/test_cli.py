"""Every command-line entry of the repository answers --help: found by itself (any .py file outside tests/ with a
`__main__` block, and the test-suite scripts run by hand), so a new script is covered without editing this file."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def entries() -> list[str]:
    """Repository-relative paths of the files that run as programs."""
    files = [p for p in ROOT.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    main = re.compile(r'^if __name__ == "__main__":', re.MULTILINE)
    return sorted(str(p.relative_to(ROOT)) for p in files if main.search(p.read_text()))


def test_the_entries_are_found():
    found = entries()
    for name in ("train.py", "eval.py", "profile_memory.py", "verify_chunked_loss.py", "data.py", "gpu_check.py",
                 "inspect_nsa.py", "train_npt.py", "benchmarks/bench_nsa.py"):
        assert name in found


@pytest.mark.parametrize("entry", entries())
def test_help_exits_zero(entry: str, monkeypatch):
    """`python FILE --help` (`python -m package.module --help` inside a package), in this process: exit 0 and a
    usage line."""
    package = (ROOT / entry).parent != ROOT and (ROOT / entry).parent.joinpath("__init__.py").is_file()
    monkeypatch.setattr(sys, "argv", [entry, "--help"])
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        if package:  # as `python -m` does, on a module no earlier test has imported (runpy warns otherwise)
            module = entry.removesuffix(".py").replace("/", ".")
            monkeypatch.delitem(sys.modules, module, raising=False)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(str(ROOT / entry), run_name="__main__")
    assert exit_info.value.code in (0, None), out.getvalue()
    assert "usage:" in out.getvalue()


@pytest.mark.slow
def test_train_help_in_a_fresh_interpreter():
    """The first command a new user types, as typed."""
    proc = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "--context_length" in proc.stdout and "70% of it" in proc.stdout


def test_a_recipe_and_the_command_line_merge_key_by_key(tmp_path, capsys):
    """The one rule for how a recipe merges (training/options.py merged_options), walked over every dict-valued
    option: --config FILE's keys stay unless the command line gives the same key; the merge is printed; a resume
    merges the given keys over the run's record the same way."""
    import dataclasses
    import json

    from training.options import TrainConfig, parse_config
    from training.resume import continue_options, record

    values = {"model_overrides": ({"nsa_window": 32, "nsa_num_selected": 8}, {"nsa_window": 16}),
              "rope_scaling": ({"rope_type": "yarn", "factor": 2.0}, {"original_max_position_embeddings": 128})}
    dicts = {f.name for f in dataclasses.fields(TrainConfig) if isinstance(getattr(TrainConfig(), f.name), dict)}
    assert dicts == set(values)  # every dict-valued option is walked
    for name, (recipe, given) in values.items():
        (tmp_path / "recipe.json").write_text(json.dumps({name: recipe}))
        cfg = parse_config(["--config", str(tmp_path / "recipe.json"), f"--{name}", json.dumps(given)])
        assert getattr(cfg, name) == {**recipe, **given}
        err = capsys.readouterr().err
        assert f"--{name} {json.dumps({**recipe, **given})}: " in err and "from the command line" in err
        run = record(TrainConfig(**{name: recipe}))
        resumed = continue_options(TrainConfig(**{name: given}), frozenset({name}), run)
        assert getattr(resumed, name) == {**recipe, **given}
