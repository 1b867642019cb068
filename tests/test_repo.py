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
    """Every reference to a section of the results by its quoted name (README, guides, docstrings) names one of the
    headings of the file it names (benchmarks/results/NAME.md), and the index (benchmarks/RESULTS.md) lists every
    file."""
    results = ROOT / "benchmarks" / "results"
    headings = {path.stem: [line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")]
                for path in results.glob("*.md")}
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*.py"), *ROOT.glob("*/*.py")]
    texts = {path.name: path.read_text() for path in files if ".venv" not in path.parts}
    names = {(file, stem, " ".join(name.split())) for file, text in texts.items()
             for stem, name in re.findall(r'results/([\w-]+)\.md`?,?\s+"([^"]+)"', text)}  # names may wrap lines
    assert names, "no reference found: the pattern is stale"
    missing = [(file, stem, name) for file, stem, name in sorted(names)
               if not any(h.startswith(name) for h in headings.get(stem, []))]
    assert not missing, f"no such section: {missing}"
    old = [file for file, text in texts.items() if re.search(r'RESULTS\.md`?,?\s+"', text)]
    assert not old, f"sections are cited by their file under benchmarks/results/ now: {old}"
    index = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert all(f"results/{stem}.md" in index for stem in headings), "list the new file in benchmarks/RESULTS.md"
