"""Every Python block of the README runs as written, and its test command is what CI runs."""

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert BLOCKS


SERVER = "http://127.0.0.1:8000/v1"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = BLOCKS[index]
    if SERVER not in code:
        exec(compile(code, f"README.md python block {index}", "exec"), {})
        return
    # The client snippet talks to `speculaas serve` as the README starts it (on a free port).
    from conftest import serve_process

    with serve_process() as url:
        scope = {}
        exec(compile(code.replace(SERVER, f"{url}/v1"), f"README.md python block {index}",
                     "exec"), scope)
        assert len(scope["res"].data) == 2


def test_ci_runs_the_readme_test_command():
    first_lines = README.read_text().split("```")[1]
    test_line = next(line for line in first_lines.splitlines() if "pytest" in line)
    ci = (README.parent / ".ci" / "run").read_text()
    assert test_line.strip() in ci
