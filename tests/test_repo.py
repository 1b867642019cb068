"""Repository hygiene: CI installs and tests exactly as README.md says."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    lines = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    commands = [line for line in lines[lines.index('cd "$(dirname "$0")/.."') + 1:]
                if line and not line.startswith(("#", "export "))]
    assert commands[-1] == "ruff check . && python -m pytest -q"
    for command in commands:
        assert command in readme, command
