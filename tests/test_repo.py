"""Repository hygiene: CI installs and tests exactly as README.md says."""

import re
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


def test_results_sections_named_in_the_repo_exist():
    """Every reference to a section of RESULTS.md by its quoted name (README, docstrings) names one of its headings."""
    headings = [line.lstrip("#").strip() for line in (ROOT / "benchmarks" / "RESULTS.md").read_text().splitlines()
                if line.startswith("#")]
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"), *ROOT.glob("*/*.py")]
    names = {(path.name, " ".join(name.split())) for path in files if ".venv" not in path.parts
             for name in re.findall(r'RESULTS\.md`?,?\s+"([^"]+)"', path.read_text())}  # names may wrap lines
    assert names, "no reference found: the pattern is stale"
    missing = [(file, name) for file, name in sorted(names) if not any(h.startswith(name) for h in headings)]
    assert not missing, f"RESULTS.md has no section for {missing}"
