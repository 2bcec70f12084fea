"""Every Python block of the README runs as written, and its test command is what CI runs."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})


def test_ci_runs_the_readme_test_command():
    first_lines = README.read_text().split("```")[1]
    test_line = next(line for line in first_lines.splitlines() if "pytest" in line)
    ci = (README.parent / ".ci" / "run").read_text()
    assert test_line.strip() in ci
