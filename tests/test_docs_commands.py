"""Every command in README.md and docs/ runs as written.

Commands are the lines of ```bash blocks (and of the scripts they run with `bash FILE` or
`sh FILE`) and inline code that starts with a program. The cheap ones run as written:
`speculaas generate` on the built-in model (in an empty folder, through the installed
`speculaas` script), `captions` and `--help`. The others (training, benchmarks, servers, GPUs,
hub checkpoints, installs) cannot run here; their arguments go through the real parser, and the
command's own checks up to the point where work starts (prompts, method specs, output paths,
cost-curve files), in the repository root as the docs say. A bare `speculaas SUBCOMMAND` in
prose names the subcommand: its `--help` must work. A generate command that repeats an earlier
one (up to its --out) is parsed, not run again.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tomllib
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^( *)```(?:bash|sh|shell|console)\n(.*?)^\1```", re.S | re.M)
INLINE = re.compile(r"`((?:speculaas|python3?|torchrun|bash|sh) [^`]+|speculaas)`")
# Shell set-up a reader types, not a program of ours.
SETUP = {"cd", "set", "mkdir", ".", "source", "export"}


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    argv: tuple[str, ...]
    inline: bool = False

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _segments(line: str) -> list[list[str]]:
    """A shell line's commands: split at &&, ; and pipes (only what runs before a pipe counts),
    comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    segments, current, piped = [], [], False
    for token in lexer:
        if token in ("&&", ";", "|", "||"):
            if current and not piped:
                segments.append(current)
            current, piped = [], token == "|"
        else:
            current.append(token)
    if current and not piped:
        segments.append(current)
    return segments


def _script_commands(text: str, where: str, first_line: int, inline: bool = False):
    text = re.sub(r"\\\n", " ", text)  # continuation lines
    for k, line in enumerate(text.splitlines()):
        if line.startswith("#!"):
            continue
        for argv in _segments(line):
            yield Command(f"{where}:{first_line + k}", tuple(argv), inline)


def _expand(cmd: Command):
    """A command, or the commands of the script it runs with bash/sh."""
    if cmd.argv[0] in ("bash", "sh") and len(cmd.argv) == 2:
        path = ROOT / cmd.argv[1]
        assert path.is_file(), f"{cmd}: no file {cmd.argv[1]}"
        yield from (c for sub in _script_commands(path.read_text(), cmd.argv[1], 1)
                    for c in _expand(sub))
    elif cmd.argv[0] not in SETUP:
        yield cmd


def doc_commands() -> list[Command]:
    found = []
    for path in DOCS:
        text, name = path.read_text(), path.relative_to(ROOT).as_posix()
        for m in SHELL_BLOCK.finditer(text):
            line = text[:m.start(2)].count("\n") + 1
            block = "\n".join(s[len(m.group(1)):] for s in m.group(2).splitlines())
            found += [c for sub in _script_commands(block, name, line) for c in _expand(sub)]
        for m in INLINE.finditer(text):
            line = text[:m.start()].count("\n") + 1
            found += [c for sub in _script_commands(" ".join(m.group(1).split()), name, line,
                                                    inline=True)
                      for c in _expand(sub)]
    return found


COMMANDS = doc_commands()


def _speculaas_args(argv: tuple[str, ...]) -> list[str] | None:
    """The arguments of `speculaas ...`, `python -m speculaas.cli ...` or `torchrun [its
    options] -m speculaas.cli ...`; None for other programs."""
    if argv[0] == "speculaas":
        return list(argv[1:])
    if "-m" in argv and argv[argv.index("-m") + 1] == "speculaas.cli":
        return list(argv[argv.index("-m") + 2:])
    return None


def _runs_here(args: list[str]) -> bool:
    """A generate call on the built-in model (or the tiny one) on the CPU: seconds."""
    opts = dict(zip(args, args[1:], strict=False))
    return (args[:1] == ["generate"] and "--help" not in args
            and opts.get("--model", "builtin") in ("builtin", "tiny")
            and opts.get("--device", "cpu") == "cpu" and "--weights" not in opts
            and opts.get("--drafter", "shipped") == "shipped")  # else a head the reader trains


def _without_out(argv: tuple[str, ...]) -> tuple[str, ...]:
    i = argv.index("--out") if "--out" in argv else len(argv)
    return argv[:i] + argv[i + 2:]


def _first_run(cmd: Command) -> bool:
    """Whether no earlier command runs the same generate (up to where it writes): a repeat is
    only parsed."""
    same = [c for c in COMMANDS if _without_out(c.argv) == _without_out(cmd.argv)]
    return same[0] == cmd


class Parsed(Exception):  # noqa: N818 - a signal, not an error
    """Raised where the command would start its work: everything before it was checked."""


def _stop(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise Parsed


def _parse_only(cmd: Command, monkeypatch, capsys) -> None:  # noqa: ANN001
    """Run the command in-process up to where its work starts; fail with what it printed if it
    exits or raises before that."""
    import speculaas
    import speculaas.bench.runner
    import speculaas.demo.app
    import speculaas.models.builtin.train
    import speculaas.serve.app
    import speculaas.serve.ray_app

    for module, name in ((speculaas, "load_model"), (speculaas.bench.runner, "run"),
                         (speculaas.serve.app, "serve"), (speculaas.demo.app, "serve"),
                         (speculaas.serve.ray_app, "serve_ray"),
                         (speculaas.models.builtin.train, "train")):
        monkeypatch.setattr(module, name, _stop)
    monkeypatch.chdir(ROOT)
    args = _speculaas_args(cmd.argv)
    if args is not None:
        from speculaas.cli import main

        def target() -> None:
            if cmd.argv[0] == "torchrun":
                from torch.distributed.run import get_args_parser

                get_args_parser().parse_args(list(cmd.argv[1:]))
            main(args)
    elif cmd.argv[0] in ("python", "python3") and cmd.argv[1].endswith(".py"):
        script = ROOT / cmd.argv[1]
        assert script.is_file(), f"{cmd}: no script {cmd.argv[1]}"
        original = argparse.ArgumentParser.parse_args

        def parse_then_stop(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            original(self, *a, **k)
            raise Parsed

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        monkeypatch.setattr(sys, "argv", list(cmd.argv[1:]))
        target = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
    else:
        pytest.fail(f"{cmd}: a program this test does not know; teach it or the docs")
    try:
        target()
    except Parsed:
        return
    except SystemExit as e:
        out = capsys.readouterr()
        pytest.fail(f"{cmd}: exited with {e.code}: {(out.err or out.out).strip()}")
    pytest.fail(f"{cmd}: finished without starting its work (did it run at all?)")


def _check_install(cmd: Command) -> None:
    """pip lines: every install of this project uses constraints.txt, names extras that exist,
    and pins torch as constraints.txt does."""
    argv = list(cmd.argv)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    constraints = (ROOT / "constraints.txt").read_text().split()
    if "-e" in argv:
        target = argv[argv.index("-e") + 1]
        assert "-c" in argv and argv[argv.index("-c") + 1] == "constraints.txt", \
            f"{cmd}: installs the project without -c constraints.txt"
        extras = re.fullmatch(r"\.(?:\[([\w,]+)\])?", target)
        assert extras, f"{cmd}: installs {target!r}, not this project"
        for extra in filter(None, (extras.group(1) or "").split(",")):
            assert extra in project["optional-dependencies"], f"{cmd}: no extra {extra!r}"
    for req in argv:
        if req.startswith("torch=="):
            assert req in constraints, f"{cmd}: {req} is not the pin in constraints.txt"


def test_docs_have_commands():
    programs = {c.argv[0] for c in COMMANDS}
    assert {"speculaas", "pip", "python", "torchrun"} <= programs
    # bash/sh scripts were expanded into their commands
    assert any(c.where.startswith("benchmarks/run_all.sh") for c in COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS, ids=str)
def test_doc_command(cmd: Command, tmp_path, monkeypatch, capsys):
    argv = cmd.argv
    assert "..." not in argv, f"{cmd}: a placeholder; write the whole command"
    if argv[0] == "pip":
        _check_install(cmd)
        return
    if argv[:3] in (("python3", "-m", "venv"), ("python", "-m", "venv")):
        return  # the reader's environment, not ours to create in a test
    if argv[:3] == ("python", "-m", "pytest"):
        return  # this suite is that command (CI runs it: test_readme)
    args = _speculaas_args(argv)
    if cmd.inline and args is not None and len(args) == 1 and args[0] != "captions":
        args = [*args, "--help"]  # prose naming a subcommand
    if args is not None and ("--help" in args or args[:1] == ["captions"]):
        from speculaas.cli import main

        with pytest.raises(SystemExit) if "--help" in args else nullcontext() as exited:
            main(args)
        assert exited is None or exited.value.code == 0, f"{cmd}: {capsys.readouterr().err}"
        return
    if args is not None and argv[0] == "speculaas" and _runs_here(args) and _first_run(cmd):
        exe = shutil.which("speculaas") or str(Path(sys.executable).parent / "speculaas")
        run = subprocess.run([exe, *args], cwd=tmp_path, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, f"{cmd}: exit {run.returncode}\n{run.stderr[-2000:]}"
        out = dict(zip(args, args[1:], strict=False)).get("--out", "out.png")
        assert (tmp_path / out).is_file(), f"{cmd}: wrote no {out}"
        return
    _parse_only(cmd, monkeypatch, capsys)


def test_doc_checks_fail_on_wrong_commands(monkeypatch, capsys):
    """Negative controls: a misspelt or missing option, an unknown caption, method option or
    torchrun flag, an install without constraints each fail."""
    for argv in (("speculaas", "train", "--outdir", "runs/x"),
                 ("speculaas", "generate", "--prompt", "a big red circle on the moon"),
                 ("speculaas", "bench", "--methods", "csd:delat=0.35"),
                 ("python", "benchmarks/object_count.py", "--captionz", "3"),
                 ("torchrun", "--nproc", "2", "-m", "speculaas.cli", "bench")):
        with pytest.raises(pytest.fail.Exception, match="exited with 2"):
            _parse_only(Command("control:1", argv), monkeypatch, capsys)
    with pytest.raises(AssertionError, match="constraints"):
        _check_install(Command("control:1", ("pip", "install", "-e", ".[demo]")))
