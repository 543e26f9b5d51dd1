"""Every ``--help`` as a user sees it (the installed ``twophase`` script, a subprocess) is
plain text: no reStructuredText or Sphinx markup, every flag and argument explained, and
no hidden flag in an example (a hidden flag is a deprecated spelling, not one to teach)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from twophase.cli import build_parser

TWOPHASE = Path(sys.executable).parent / "twophase"
MARKUP = re.compile(r"``|:(class|func|meth|mod|attr|ref|doc|data|exc|obj):`|^\s*\.\. ", re.M)
ENTRY = re.compile(r"^  (\S.*?)(?: {2,}(\S.*))?$")  # "  -f, --flag VALUE   help ..."


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _help(*command: str) -> str:
    out = subprocess.run([str(TWOPHASE), *command, "--help"], capture_output=True,
                         text=True, timeout=60, check=False,
                         env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, (command, out.stderr)
    return out.stdout


def _undocumented(text: str) -> list[str]:
    """Entries of the arguments and options sections that have no help beside or under
    them, read from the rendered text."""
    missing, section = [], False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^(options|positional arguments|[a-z ]+ arguments):$", line):
            section = True
            continue
        if section and line and not line.startswith(" "):
            section = False
        m = ENTRY.match(line) if section else None
        if m is None or m.group(2):
            continue
        below = lines[i + 1] if i + 1 < len(lines) else ""
        continued = below.startswith("    ") and not below.lstrip().startswith("-")
        if not continued:
            missing.append(m.group(1))
    return missing


def _hidden(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for a in parser._actions if a.help == argparse.SUPPRESS
            for flag in a.option_strings}


def test_the_parser_explains_every_flag() -> None:
    """The same rule read from the parser itself (a check on the text check above)."""
    for name, parser in _commands().items():
        for action in parser._actions:
            assert action.help, (name, action.option_strings or action.dest)


def test_the_top_level_help_is_plain_and_names_every_command() -> None:
    text = _help()
    assert MARKUP.search(text) is None, MARKUP.search(text)
    assert _undocumented(text) == []
    for name, parser in _commands().items():
        assert f"    {name}" in text, name
        for line in text.splitlines():
            if f"twophase {name} " in line:
                shown = [f for f in _hidden(parser) if re.search(rf"(?<![\w-]){f}(?![\w-])",
                                                                 line)]
                assert not shown, (line, shown)


@pytest.mark.parametrize("name", sorted(_commands()))
def test_each_command_help_is_plain_and_complete(name: str) -> None:
    text = _help(name)
    found = MARKUP.search(text)
    assert found is None, f"markup {found.group(0)!r} in `twophase {name} --help`:\n{text}"
    assert _undocumented(text) == [], (name, _undocumented(text))
    assert "examples:" in text, name
    for flag in _hidden(_commands()[name]):
        assert re.search(rf"(?<![\w-]){flag}(?![\w-])", text) is None, (name, flag)


def test_the_checks_catch_what_they_look_for() -> None:
    """The detectors find each kind of defect in a made-up help text."""
    bad = ("usage: x\n\n``twophase x``: see :class:`Y`\n.. note:: z\n\noptions:\n"
           "  -h, --help  show this help message and exit\n  --bare\n"
           "  --long-flag-without-room VALUE\n                        its help below\n"
           "  --last VALUE\n")
    assert [m.group(0) for m in MARKUP.finditer(bad)] == ["``", "``", ":class:`", ".. "]
    assert _undocumented(bad) == ["--bare", "--last VALUE"]


def _examples(text: str) -> list[str]:
    """The command lines of a help's examples (a description after two spaces dropped,
    ``\\`` continuations joined, a leading VAR=value dropped)."""
    out: list[str] = []
    pending = ""
    for line in text.splitlines():
        body = line.strip()
        if pending:
            pending += " " + body.rstrip("\\").strip()
            if not body.endswith("\\"):
                out.append(pending)
                pending = ""
            continue
        body = re.sub(r"^([A-Z_]+=\S+ )+", "", body)
        if not line.startswith("  ") or not body.startswith("twophase"):
            continue
        command = re.split(r" {2,}", body)[0].split(" | ")[0]  # its output piped on
        if command.endswith("\\"):
            pending = command.rstrip("\\").strip()
        else:
            out.append(command)
    return out


@pytest.mark.parametrize("name", ["", *sorted(_commands())])
def test_every_example_parses(name: str) -> None:
    """Each example is a command the parser accepts (a renamed or mistyped flag fails)."""
    import shlex

    examples = _examples(_help(*([name] if name else [])))
    assert examples, name
    for example in examples:
        words = shlex.split(example)
        # a shell redirection or pipe ends the command's own words
        ends = [i for i, w in enumerate(words) if w in {">", ">>", "|", "<"}]
        argv = words[1:ends[0]] if ends else words[1:]
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"`twophase {name} --help` shows {example!r}, which exits {exc.code}")
