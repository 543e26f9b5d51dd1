"""The user documentation cannot drift from the code, and it builds.

- Each table of ``docs/user/`` marked ``<!-- reference: TARGET -->`` is compared with
  the code: a class's ``__init__`` signature (names and defaults), a subcommand's
  argparse options (names, defaults, and which default an environment variable sets),
  or pyproject's extras. A documented option the code lacks, an option the page lacks,
  or another default fails here. Every class registered as a participant kind, every
  subcommand and ``TransactionalSink`` must have its table.
- The compatibility page names the versions the repository pins for its tests.
- The site builds with ``mkdocs build --strict`` (a warning, a broken link or anchor
  fails it), and a deliberately broken link does fail it.
- That no page carries development history or figures of its own, and the facts stated
  once (schema, barrier stages, environment, versions): tests/system/test_doc_facts.py.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import importlib
import inspect
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
USER_PAGES = sorted((DOCS / "user").glob("*.md"))
BLOCK = re.compile(r"<!-- reference: (.+?) -->\n((?:\|.*\n?)+)")
CODE_DIRS = (ROOT / "twophase", ROOT / "sinks", ROOT / "coordinator")
ENV_NAME = re.compile(r"""["'](TWOPHASE_[A-Z_]+)["']""")


class _Required:
    def __repr__(self) -> str:
        return "required"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class Documented:
    """One documented option: its default, or the variable whose value becomes it (then
    ``value`` is what applies when the variable is unset)."""

    value: Any
    env: str | None = None


def _default(cell: str, where: str) -> Documented:
    if cell.strip() == "required":
        return Documented(REQUIRED)
    literals = re.findall(r"`([^`]*)`", cell)
    assert literals, f"{where}: the default {cell!r} is neither 'required' nor `a literal`"
    env = literals.pop(0)[1:] if literals[0].startswith("$") else None
    try:
        value = ast.literal_eval(literals[0]) if literals else None
    except (ValueError, SyntaxError):
        raise AssertionError(f"{where}: the default `{literals[0]}` is not a Python "
                             "literal") from None
    return Documented(value, env=env)


def _blocks() -> dict[str, dict[str, Documented]]:
    """Every reference table of the user pages: target -> option -> documented default."""
    found: dict[str, dict[str, Documented]] = {}
    for page in USER_PAGES:
        for target, table in BLOCK.findall(page.read_text(encoding="utf-8")):
            if target == "extras":  # requirements, not options: test_the_extras_table_...
                continue
            assert target not in found, f"two reference tables for {target}"
            rows: dict[str, Documented] = {}
            for line in table.strip().splitlines()[2:]:  # header, separator
                name, cell, _meaning = line.strip().strip("|").split("|", 2)
                name = name.strip().strip("`")
                where = f"{page.name}, {target}, {name}"
                assert name not in rows, f"{where}: listed twice"
                rows[name] = _default(cell, where)
            found[target] = rows
    return found


BLOCKS = _blocks()


def _same(doc: Any, code: Any) -> bool:
    return doc is code or (type(doc) is type(code) and doc == code)


def _compare(target: str, code: dict[str, Any], env_code: dict[str, Any] | None = None
             ) -> list[str]:
    """What differs between the documented table and the code's options."""
    documented = BLOCKS[target]
    problems = [f"{target}: {name} is not documented (default {code[name]!r})"
                for name in code if name not in documented]
    problems += [f"{target}: {name} is documented but the code has no such option"
                 for name in documented if name not in code]
    for name, doc in documented.items():
        if name not in code:
            continue
        if doc.env is None and not _same(doc.value, code[name]):
            problems.append(f"{target}: {name} defaults to {code[name]!r} in the code, "
                            f"the page says {doc.value!r}")
        if env_code is None:
            continue
        wired = env_code[name] != code[name]
        if doc.env is None and wired:
            problems.append(f"{target}: {name}'s default comes from the environment "
                            f"({env_code[name]!r}), the page names no variable")
        if doc.env is not None:
            if env_code[name] != f"<{doc.env}>":
                problems.append(f"{target}: {name} does not default to ${doc.env} "
                                f"(with it set, the default is {env_code[name]!r})")
            if not _same(doc.value, code[name]):
                problems.append(f"{target}: without ${doc.env}, {name} defaults to "
                                f"{code[name]!r}, the page says {doc.value!r}")
    return problems


def _participant_targets() -> list[str]:
    """``TransactionalSink`` and every class registered as a participant kind."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    kinds = meta["entry-points"]["twophase.participants"]
    return ["twophase.TransactionalSink", *(v.replace(":", ".") for v in kinds.values())]


def _env_names() -> set[str]:
    """The TWOPHASE_* variables the package reads (its test helpers aside)."""
    names: set[str] = set()
    for top in CODE_DIRS:
        for path in top.rglob("*.py"):
            if "testing" not in path.relative_to(ROOT).parts:
                names |= set(ENV_NAME.findall(path.read_text(encoding="utf-8")))
    return names


@pytest.mark.parametrize("target", _participant_targets())
def test_class_options_match_the_signature(target: str) -> None:
    assert target in BLOCKS, f"docs/user has no '<!-- reference: {target} -->' table"
    module, _, name = target.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # self
    code = {p.name: REQUIRED if p.default is p.empty else p.default for p in params}
    assert not _compare(target, code), "\n".join(_compare(target, code))


def _commands(environ: dict[str, str]) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers, built under ``environ`` (defaults read the environment
    when a parser is built)."""
    from twophase.cli import build_parser

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environ)
    try:
        parser = build_parser()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _options(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """A parser's documented options: the first spelling of each flag (``--coordinator``,
    not its alias ``--store``), positionals by their metavar; hidden ones left out."""
    out: dict[str, Any] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            out[action.option_strings[0]] = REQUIRED if action.required else action.default
        else:
            name = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
            out[name] = REQUIRED if action.nargs is None else action.default
    return out


BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_")}
SET_ENV = {**BASE_ENV, **{name: f"<{name}>" for name in _env_names()}}
COMMANDS = sorted(_commands(BASE_ENV))


@pytest.mark.parametrize("command", COMMANDS)
def test_cli_options_match_the_parser(command: str) -> None:
    target = f"cli {command}"
    assert target in BLOCKS, f"docs/user has no '<!-- reference: {target} -->' table"
    code = _options(_commands(BASE_ENV)[command])
    with_env = _options(_commands(SET_ENV)[command])
    problems = _compare(target, code, with_env)
    assert not problems, "\n".join(problems)


def test_every_reference_table_names_something_that_exists() -> None:
    known = {*_participant_targets(), *(f"cli {c}" for c in COMMANDS), "extras"}
    assert set(BLOCKS) <= known, sorted(set(BLOCKS) - known)


def test_the_extras_table_is_pyproject() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {"(core)": meta["dependencies"], **meta["optional-dependencies"]}
    del wanted["dev"]  # the test suite's tools, named in prose only
    page = (DOCS / "user" / "installation.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- reference: extras -->\n((?:\|.*\n)+)", page)
    assert match, "installation.md has no '<!-- reference: extras -->' table"
    rows = {}
    for line in match[1].strip().splitlines()[2:]:
        extra, pulls, _why = line.strip().strip("|").split("|", 2)
        rows[extra.strip().strip("`")] = sorted(re.findall(r"`([^`]*)`", pulls))
    assert sorted(rows) == sorted(wanted), (sorted(rows), sorted(wanted))
    for extra, requirements in wanted.items():
        assert rows[extra] == sorted(requirements), (extra, rows[extra], requirements)


def test_the_stated_limits_are_the_codes(tmp_path: Path) -> None:
    """The limits tables of configuration.md (the sink's bounds) and cli.md (the daemon's,
    read from its own OpenAPI document) say what the code enforces."""
    from twophase.coordinator.app import create_app
    from twophase.coordinator.guard import MAX_BODY
    from twophase.coordinator.store import Store
    from twophase.options import MAX_PARTICIPANTS, MAX_PARTITIONS, MAX_VOTE_TIMEOUT

    days = MAX_VOTE_TIMEOUT / 86400
    sink_rows = [f"| participants per sink | {MAX_PARTICIPANTS} |",
                 f"| partitions per batch | 1 to {MAX_PARTITIONS:,} |",
                 f"| `vote_timeout` | more than 0, at most {days:g} days "
                 f"({MAX_VOTE_TIMEOUT:,.0f} s) |"]
    store = Store(f"sqlite:///{tmp_path / 'c.db'}")
    try:
        api = create_app(store, "t").openapi()
    finally:
        store.close()
    schemas = api["components"]["schemas"]
    begin = schemas["BeginIn"]["properties"]
    poll = next(p["schema"] for path, ops in api["paths"].items() if path.endswith("/decision")
                for p in ops["get"]["parameters"] if p["name"] == "timeout")
    votes, acks = (schemas[m]["properties"][f]["maxItems"]
                   for m, f in (("VotesIn", "votes"), ("AcksIn", "acks")))
    assert votes == acks
    assert MAX_BODY % (1 << 20) == 0
    daemon_rows = [
        f"| participants per sink | {begin['participants']['maxItems']} |",
        f"| partitions per transaction | {begin['partitions']['maximum']:,.0f} |",
        f"| `vote_timeout` | more than 0, at most {begin['vote_timeout']['maximum'] / 86400:g}"
        " days |",
        f"| votes or acks per request | {votes:,} |",
        f"| request body | {MAX_BODY >> 20} MiB (`413 body_too_large`) |",
        f"| a long-poll for a decision | at most {poll['maximum']:g} s per request |",
        f"| free text (reasons) | {schemas['AbandonIn']['properties']['reason']['maxLength']}"
        " characters, no NUL |",
    ]
    for page, rows in (("configuration.md", sink_rows), ("cli.md", daemon_rows)):
        text = (DOCS / "user" / page).read_text(encoding="utf-8")
        missing = [row for row in rows if row not in text]
        assert not missing, f"{page} does not state: {missing}"


def _pinned(path: str, tag: str) -> str:
    match = re.search(rf"<{re.escape(tag)}>([^<]+)</", (ROOT / path).read_text())
    assert match, (path, tag)
    return match[1]


def test_the_compatibility_page_names_the_pinned_versions() -> None:
    page = (DOCS / "user" / "compatibility.md").read_text(encoding="utf-8")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reader = re.search(r'READER_PYSPARK = "([^"]+)"',
                       (ROOT / "tests/support/spark_connectors.py").read_text())
    assert reader
    connectors = "tools/spark-connectors/pom.xml"
    expected = [
        f"Apache Kafka {_pinned('twophase/testing/kafka-broker.pom.xml', 'kafka.version')}",
        f"`delta-spark_2.13` {_pinned(connectors, 'delta.version')}",
        f"`iceberg-spark-runtime-{_pinned(connectors, 'iceberg.spark')}_2.13` "
        f"{_pinned(connectors, 'iceberg.version')}",
        f"pyspark {reader[1]}",
        next(r for r in meta["optional-dependencies"]["spark"] if r.startswith("pyspark")),
        ", ".join(c.rsplit(" ", 1)[1] for c in meta["classifiers"]
                  if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)),
    ]
    missing = [text for text in expected if text not in page]
    assert not missing, f"compatibility.md does not say: {missing}"


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed beside this interpreter: "
                    "pip install -e '.[dev]' (it brings mkdocs)")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
         "-d", str(site)], capture_output=True, text=True, timeout=120, check=False)


def test_the_site_builds_strict(tmp_path: Path) -> None:
    out = _mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stderr + out.stdout
    for page in ("index.html", "user/configuration/index.html", "decisions/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


@pytest.fixture
def docs_copy(tmp_path: Path) -> Iterator[Path]:
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    yield tmp_path


def test_a_broken_link_or_anchor_fails_the_build(docs_copy: Path) -> None:
    page = docs_copy / "docs" / "user" / "installation.md"
    page.write_text(page.read_text() + "\n[gone](nowhere.md) and "
                    "[no anchor](configuration.md#no-such-option)\n")
    out = _mkdocs(docs_copy / "mkdocs.yml", docs_copy / "site")
    assert out.returncode != 0
    assert "nowhere.md" in out.stderr and "no-such-option" in out.stderr, out.stderr


# ---- the troubleshooting page quotes the code's messages --------------------------------
PLACEHOLDER = re.compile(r"'?<[^<>]*>'?|\.\.\.|\(\.\.\.\)|\[\.\.\.\]")
MIN_PIECE = 8  # a shorter common run proves nothing, unless it is a whole literal part
MIN_PART = 4


def _literals() -> list[tuple[str, set[str]]]:
    """Every string literal of the package as (text, parts): an f-string's fields cut
    out (NUL between its literal parts, so that no quoted piece spans a field), and its
    literal parts (what sits between two fields, such as " lacks ")."""
    out: list[tuple[str, set[str]]] = []
    for top in CODE_DIRS:
        for path in top.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.JoinedStr):
                    pieces = [v.value for v in node.values
                              if isinstance(v, ast.Constant) and isinstance(v.value, str)]
                    out.append(("\0".join(pieces), {p for p in pieces if len(p) >= MIN_PART}))
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append((node.value, set()))
    return out


def _sources(chunks: list[str], literals: list[tuple[str, set[str]]], joined: str,
             starts: list[int]) -> str:
    """The literals a quoted line can come from: those sharing a 12-character run with
    it (so that a reworded part is not excused by a like phrase elsewhere), joined."""
    found: set[int] = set()
    for chunk in chunks:
        for i in range(0, max(len(chunk) - 12, 0) + 1, 4):
            window, at = chunk[i:i + 12], joined.find(chunk[i:i + 12])
            while len(window) == 12 and at >= 0:
                found.add(bisect.bisect_right(starts, at) - 1)
                at = joined.find(window, at + 1)
    return "\0".join(literals[k][0] for k in sorted(found))


def _covered(chunk: str, corpus: str, parts: set[str]) -> int:
    """Characters of ``chunk`` covered, from the left: by the longest run of at least
    MIN_PIECE characters found in the corpus (the line's sources), else by a whole
    f-string literal part of any message (" batch ", " failed: ");
    a character neither covers is skipped (a number the page does not mark as a
    placeholder only costs itself)."""
    covered, i = 0, 0
    while i < len(chunk):
        lo, hi = 0, len(chunk) - i  # the longest prefix of chunk[i:] in the corpus
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chunk[i:i + mid] in corpus:
                lo = mid
            else:
                hi = mid - 1
        if lo < MIN_PIECE:
            lo = max((len(p) for p in parts if chunk.startswith(p, i)), default=0)
        if lo:
            covered += lo
            i += lo
        else:
            i += 1
    return covered


def test_troubleshooting_quotes_the_messages_the_code_prints() -> None:
    page = (DOCS / "user" / "troubleshooting.md").read_text(encoding="utf-8")
    literals = _literals()
    parts = set().union(*(p for _, p in literals))
    joined = "\1".join(text for text, _ in literals)
    starts = list(itertools.accumulate((len(t) + 1 for t, _ in literals[:-1]), initial=0))
    quoted = [line.strip().removeprefix("- ") for block
              in re.findall(r"```text\n(.*?)```", page, re.S)
              for line in block.splitlines() if line.strip()]
    assert len(quoted) >= 20, quoted
    drifted = []
    for line in quoted:
        chunks = [c for c in PLACEHOLDER.split(line) if len(c.strip()) >= MIN_PART]
        corpus = _sources(chunks, literals, joined, starts)
        size = sum(len(c) for c in chunks)
        hit = sum(_covered(c, corpus, parts) for c in chunks)
        if size and hit < 0.9 * size:
            drifted.append(f"{hit / size:.0%} found: {line}")
    assert not drifted, "quoted on troubleshooting.md, not printed by the code:\n" + \
        "\n".join(drifted)
