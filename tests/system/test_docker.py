"""docker/ without a Docker engine: the compose file is valid against the Compose
Specification's JSON schema, its services have health checks and restart policies and
wait for each other, and every image's build inputs exist.

The schema is vendored as docker/compose-spec.schema.json (see docker/README.md for where
it comes from).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((DOCKER / "compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def test_compose_file_matches_the_compose_specification() -> None:
    schema = json.loads((DOCKER / "compose-spec.schema.json").read_text())
    validator = jsonschema.Draft201909Validator(
        schema, format_checker=jsonschema.Draft201909Validator.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(_compose()), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_check_catches_a_bad_file() -> None:
    """The check can fail: a misspelt key and a wrong type are reported."""
    schema = json.loads((DOCKER / "compose-spec.schema.json").read_text())
    bad = _compose()
    bad["services"]["coordinator"]["restart_policy"] = "always"
    bad["services"]["postgres"]["ports"] = "5432:5432"
    errors = list(jsonschema.Draft201909Validator(schema).iter_errors(bad))
    assert len(errors) >= 2


def test_services_wait_for_each_other_and_restart() -> None:
    services = _compose()["services"]
    assert set(services) >= {"kafka", "postgres", "coordinator", "job"}
    for name in ("kafka", "postgres", "coordinator"):
        assert "test" in services[name]["healthcheck"], name
        assert services[name]["restart"] == "unless-stopped", name
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown service {dep}"
    job = services["job"]
    assert {d: c["condition"] for d, c in job["depends_on"].items()} == {
        "kafka": "service_healthy", "postgres": "service_healthy",
        "coordinator": "service_healthy"}
    cmd = job["command"]
    assert cmd[:2] == ["twophase", "demo"]
    assert cmd[cmd.index("--coordinator") + 1] == "http://coordinator:7070"
    assert cmd[cmd.index("--kafka-bootstrap") + 1] == "kafka:19092"
    kafka_env = services["kafka"]["environment"]
    assert "INTERNAL://kafka:19092" in kafka_env["KAFKA_ADVERTISED_LISTENERS"]
    # the coordinator waits for its store instead of dying: the image passes the wait on
    assert services["coordinator"]["environment"]["TWOPHASE_STORE_WAIT"]


def _dockerfiles() -> list[tuple[str, Path, Path]]:
    out = []
    for name, svc in _compose()["services"].items():
        build = svc.get("build")
        if build:
            context = (DOCKER / build["context"]).resolve()
            out.append((name, context, context / build["dockerfile"]))
    return out


@pytest.mark.parametrize(("service", "context", "dockerfile"), _dockerfiles(),
                         ids=[s for s, _, _ in _dockerfiles()])
def test_build_inputs_exist(service: str, context: Path, dockerfile: Path) -> None:
    assert dockerfile.is_file(), f"{service}: no {dockerfile}"
    text = dockerfile.read_text()
    lines = [ln.strip() for ln in text.replace("\\\n", " ").splitlines()]
    assert any(ln.startswith("FROM ") for ln in lines)
    copies = [shlex.split(ln)[1:-1] for ln in lines if ln.startswith(("COPY ", "ADD "))]
    assert copies, f"{service}: nothing copied into the image"
    for sources in copies:
        for src in sources:
            if src.startswith("--"):
                continue
            assert (context / src).exists(), f"{service}: COPY source {src} not in {context}"
    # what `pip install .[extra]` needs is what was copied
    for m in re.finditer(r'pip install "\.\[(\w+)\]"', text):
        extras = (ROOT / "pyproject.toml").read_text()
        assert re.search(rf"^{m[1]} = \[", extras, re.M), f"{service}: unknown extra {m[1]}"
    # the CLI it runs accepts the options the files pass
    if service == "coordinator":
        assert "--store-wait" in text


def test_the_job_options_exist() -> None:
    """The job service's command is one the CLI accepts (parsed, not run)."""
    from twophase.cli import build_parser

    args = build_parser().parse_args(_compose()["services"]["job"]["command"][1:])
    assert args.coordinator == "http://coordinator:7070"
    assert args.batches == 5
