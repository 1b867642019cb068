"""Repository hygiene: CI runs exactly the README's test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert "pytest" in command and command in readme
