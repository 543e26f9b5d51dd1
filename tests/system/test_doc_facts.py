"""Facts operators act on are stated once, from the code, and the pages say how it works
now.

Each fact the pages state is checked against its one definition in the code: the store
schema version and the messages about it, that no participant runs a barrier stage, the
environment variables the code reads (cli.md's table, both ways), the Kafka timeout
rule, the version in pyproject against CHANGELOG, the README's tagline against the user
guide's, what ``scripts/test.sh`` installs against the README, and every test file a
page cites. And no user or reference page carries development history (issue or session
numbers, commit hashes, load averages) or measured rates of its own: those live in
docs/decisions.md, the development record of docs/performance.md, and the results of
docs/chaos.md.
"""

from __future__ import annotations

import importlib
import re
import sqlite3
from pathlib import Path

import pytest
import tomllib

import twophase
from twophase.errors import InvalidRequest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RECORD_HEADING = "## Development record"


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _now_pages() -> dict[str, str]:
    """Every user and reference page as it must read now: the README, ARCHITECTURE.md,
    every page under docs/ but the design record, and docs/performance.md up to its
    development record."""
    pages = {p.relative_to(ROOT).as_posix(): _read(p)
             for p in [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *DOCS.rglob("*.md")]
             if p.name != "decisions.md"}
    perf = pages["docs/performance.md"]
    assert RECORD_HEADING in perf, "docs/performance.md lost its development record heading"
    pages["docs/performance.md"] = perf.split(RECORD_HEADING, 1)[0]
    return pages


PAGES = _now_pages()

HISTORY = {
    "a session": re.compile(r"\bsessions? \d+|\bthe session before|\blast session\b", re.I),
    "an issue number": re.compile(r"\bissues? #?\d+|\bissue-\d+", re.I),
    "a load average": re.compile(r"\bload( average)?( of)? ~?\d|\bload p50", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "a worktree": re.compile(r"\bwt-[a-z]+|\bworktree\b", re.I),
}
RATES = {
    "a measured rate": re.compile(r"\d[\d,.]* ?(rows/s|tx/s|rounds/s|MB/s|batches/s)"),
    "a percentile": re.compile(r"\bp(50|90|95|99)\b"),
}
FIGURE_PAGES = {"docs/performance.md", "docs/chaos.md"}


def _found(rules: dict[str, re.Pattern[str]], name: str, text: str) -> list[str]:
    return [f"{name}:{n}: {what}: {m[0]!r}"
            for n, line in enumerate(text.splitlines(), 1)
            for what, rx in rules.items() for m in [rx.search(line)] if m]


@pytest.mark.parametrize("name", sorted(PAGES))
def test_the_page_says_how_it_works_now(name: str) -> None:
    found = _found(HISTORY, name, PAGES[name])
    if name not in FIGURE_PAGES:
        found += _found(RATES, name, PAGES[name])
    assert not found, ("development history belongs in docs/decisions.md or under "
                       f"performance.md's {RECORD_HEADING!r}; figures in performance.md's "
                       "table:\n" + "\n".join(found))


def test_the_history_rule_catches_what_it_names() -> None:
    bad = ("as in session 9, main at 692006e", "Issue 24: not the default yet",
           "load average 3-7", "measured at load 0.1", "the session before: 0.99",
           "SQLite 486-755 rounds/s")
    rules = {**HISTORY, **RATES}
    assert all(_found(rules, "x", line) for line in bad)
    assert not _found(rules, "x", "a transaction's fixed cost, in the default run")


# ---- the store's schema version --------------------------------------------------------
def test_the_pages_give_the_codes_store_schema(tmp_path: Path) -> None:
    from twophase.coordinator.schema import _UPGRADABLE, SCHEMA_VERSION
    from twophase.coordinator.store import Store
    from twophase.errors import SchemaMismatch

    ops = _read(DOCS / "user" / "operations.md")
    rows = re.findall(r"^\| ([0-9.x, ]+) \| (\d+) \| (.*)\|$", ops, re.M)
    assert rows, "operations.md lost its table of schema versions"
    current, schema, older = rows[-1]
    assert int(schema) == SCHEMA_VERSION, f"operations.md: {current} has schema {schema}"
    upgraded = re.search(r"schema ([\d, or]+) (is|are) upgraded", older)
    assert upgraded and set(re.findall(r"\d+", upgraded[1])) == set(_UPGRADABLE), older
    # the messages the troubleshooting page quotes, as a store of each kind gets them
    trouble = _read(DOCS / "user" / "troubleshooting.md")
    for found in [*sorted(_UPGRADABLE), "1"]:
        db = tmp_path / f"v{found}.db"
        Store(f"sqlite:///{db}").close()
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE twophase_meta SET value = ? WHERE key = 'schema_version'",
                         (found,))
        with pytest.raises(SchemaMismatch) as err:
            Store(f"sqlite:///{db}", create=False).close()
        message = str(err.value).replace(f"sqlite:///{db}", "<where>")
        generic = message.replace(f"version {found}", "version <v>", 1)
        assert message in trouble or generic in trouble, message
    changelog = _read(ROOT / "CHANGELOG.md")
    newest = re.search(r"Store schema (\d+)", changelog)
    assert newest and int(newest[1]) == SCHEMA_VERSION, "CHANGELOG's newest store schema"


# ---- no participant runs a barrier stage --------------------------------------------------
def _kinds() -> dict[str, str]:
    meta = tomllib.loads(_read(ROOT / "pyproject.toml"))["project"]
    return dict(meta["entry-points"]["twophase.participants"])


def _class(target: str) -> type:
    module, name = target.split(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def test_every_built_in_participant_prepares_durably() -> None:
    """No built-in kind declares ``durable_prepare = False`` (the sink refuses it since
    the barrier stage was retired: tests/protocol/test_participant_contract.py)."""
    kinds = _kinds()
    assert kinds
    for kind, target in kinds.items():
        assert getattr(_class(target), "durable_prepare", True) is not False, kind


def test_the_pages_offer_no_barrier_stage() -> None:
    """Every paragraph (or table row) that names a barrier stage, a slot per partition
    or dynamic allocation off as something a sink needs says it was retired."""
    wrong = []
    for name, text in PAGES.items():
        units = [u for para in re.split(r"\n\s*\n", text)
                 for u in (para.splitlines() if para.lstrip().startswith("|") else [para])]
        for para in units:
            flat = " ".join(para.split())
            # "no barrier stage" / "without a barrier stage" says the opposite: not a tie
            flat = re.sub(r"\b(no|without( a)?) barrier stage", "", flat, flags=re.I)
            ties = re.search(r"barrier stage|dynamic allocation (must be )?off|"
                             r"dynamicAllocation\.enabled=false", flat, re.I)
            if ties and "retired" not in flat and not flat.startswith("```"):
                wrong.append(f"{name}: {flat[:160]}")
    assert not wrong, "a barrier stage offered (retired in 0.4):\n" + "\n".join(wrong)


def test_no_page_offers_the_retired_in_task_prepare() -> None:
    """Every paragraph naming ``prepare="in_task"`` says it was retired."""
    wrong = [f"{name}: {' '.join(para.split())[:160]}" for name, text in PAGES.items()
             for para in re.split(r"\n\s*\n", text)
             if "in_task" in para and "retired" not in para]
    assert not wrong, "\n".join(wrong)


def test_the_kafka_timeout_rule_is_the_codes() -> None:
    """``transaction_timeout_ms`` must exceed ``vote_timeout`` + 60 s only where a
    transaction stays open while the batch votes (the resumable prepare, the default),
    as configuration.md says; the staged prepare is exempt."""
    from twophase.sinks.kafka import KafkaParticipant

    config = {"bootstrap.servers": "127.0.0.1:9"}
    KafkaParticipant("t", config, transaction_timeout_ms=1000,
                     prepare="staged").check_vote_window(600)
    for kw in ({}, {"prepare": "resumable"}):
        with pytest.raises(InvalidRequest, match="vote_timeout"):
            KafkaParticipant("t", config, transaction_timeout_ms=1000,
                             **kw).check_vote_window(600)
    row = next(line for line in _read(DOCS / "user" / "configuration.md").splitlines()
               if line.startswith("| `transaction_timeout_ms` |"))
    assert "prepare='resumable'" in row, row
    assert "+ 60 s" in row and "(the default)" in row, row


# ---- environment variables ---------------------------------------------------------------
def test_the_environment_table_is_what_the_code_reads() -> None:
    from tests.system.test_docs import _env_names

    cli = _read(DOCS / "user" / "cli.md")
    table = cli.split("## Environment variables", 1)[1].split("\n#", 1)[0]
    first = "\n".join(line.split("|")[1] for line in table.splitlines()
                      if line.startswith("| `"))
    listed = {re.sub(r"<[^>]*>.*", "", v) for v in re.findall(r"`(TWOPHASE_[A-Z_<>]+)`", first)}
    read = _env_names()
    assert read - listed == set(), f"read by the code, not in cli.md's table: {read - listed}"
    assert listed - read == set(), f"in cli.md's table, read by no code: {listed - read}"


# ---- the HTTP API's error codes --------------------------------------------------------------
def test_the_error_table_is_what_the_daemon_answers() -> None:
    """coordinator-api.md's table of (status, code) against the code: the error classes'
    codes and statuses (every refusal of the state machine among them) and the codes the
    service writes itself (``_error(413, "body_too_large", ...)``)."""
    from twophase import errors

    api = _read(DOCS / "coordinator-api.md")
    table = api.split("## Errors", 1)[1].split("\n## ", 1)[0]
    documented = {(int(status), code) for status, codes in
                  re.findall(r"^\| (\d{3}) \| (.+?) \|", table, re.M)
                  for code in re.findall(r"`([a-z_]+)`", codes)}
    classes = {c.code: c.http_status for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, errors.TwophaseError)}
    written = {(int(status), code)
               for path in (ROOT / "coordinator").glob("*.py")
               for status, code in re.findall(r"\b([1-5]\d\d)(?:,|:) \"([a-z_]+)\"",
                                              _read(path))}
    refusals = {(c.http_status, c.code) for c in vars(errors).values()
                if isinstance(c, type) and issubclass(c, errors.ProtocolError)}
    unreal = {(s, c) for s, c in documented if classes.get(c) != s and (s, c) not in written}
    assert not unreal, f"documented, but the daemon never answers so: {unreal}"
    missing = (written | refusals) - documented
    assert not missing, f"the daemon answers so, coordinator-api.md does not say: {missing}"


# ---- versions and the front page -----------------------------------------------------------
def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def test_the_changelog_dates_the_packages_version() -> None:
    version = twophase.__version__  # the one version source; pyproject reads it
    changelog = _read(ROOT / "CHANGELOG.md")
    heads = re.findall(r"^## (.+)$", changelog, re.M)
    dated = re.compile(r"(\d+\.\d+\.\d+) \((\d{4}-\d\d-\d\d)\)")
    released = {m[1]: m[2] for h in heads if (m := dated.fullmatch(h))}
    unreleased = [h for h in heads if h.startswith("Unreleased")]
    assert all(h in unreleased or dated.fullmatch(h) for h in heads), heads
    base = re.match(r"\d+\.\d+\.\d+", version)
    assert base, version
    if base[0] == version:  # a release: dated
        assert version in released, f"pyproject's {version} has no dated CHANGELOG section"
    for head in unreleased:  # what comes next names a version above every release
        assert re.fullmatch(r"Unreleased \((\d+\.\d+\.\d+)\)", head), head
        assert _version(head) > max(_version(v) for v in released), head
    assert "no version has been tagged" not in changelog.lower()


def _tagline(text: str) -> str:
    body = text.split("\n# ", 1)[-1] if not text.startswith("# ") else text
    return " ".join(body.split("\n\n", 2)[1].split())


def test_the_readme_and_the_user_guide_say_the_same_thing_first() -> None:
    assert _tagline(_read(ROOT / "README.md")) == _tagline(_read(DOCS / "index.md"))


def test_the_readme_names_what_the_test_command_installs() -> None:
    script = _read(ROOT / "scripts" / "test.sh")
    packages = {pkg for line in re.findall(r"^\s*apt_install (.+)$", script, re.M)
                for pkg in line.split() if not pkg.startswith(("-", '"'))}
    assert {"postgresql", "mariadb-server", "maven"} <= packages, packages
    readme = _read(ROOT / "README.md")
    named = {p for p in packages if f"`{p}`" in readme or
             (p.startswith("openjdk") and "a Java runtime" in readme)}
    assert named == packages, f"scripts/test.sh installs, the README does not say: " \
        f"{packages - named}"


def test_every_test_file_a_page_cites_exists() -> None:
    missing = sorted({f"{name}: {path}" for name, text in PAGES.items()
                      for path in re.findall(r"\btests/[\w/]+\.py\b", text)
                      if not (ROOT / path).is_file()})
    assert not missing, missing


def test_the_readme_is_a_front_page() -> None:
    lines = _read(ROOT / "README.md").splitlines()
    assert len(lines) <= 160, f"README.md has {len(lines)} lines: the rest belongs in docs/"
