"""Apache Kafka's broker jars, resolved once through Maven and cached.

Why: no Kafka distribution is installed on the project's machines or CI, but Maven Central
is reachable; ``kafka-broker.pom.xml`` (beside this module) names ``kafka_2.13`` and a
log4j2 backend, and ``mvn dependency:copy-dependencies`` copies them with every runtime
dependency into one folder, the classpath of ``java kafka.Kafka``. The folder is keyed by
the pom's content, so a changed pom builds a new one and an unchanged one is reused.

``$TWOPHASE_KAFKA_LIBS`` names a ready folder of jars instead (an offline machine).

The same jars hold Kafka's command-line tools (``kafka-tools``): :func:`tool_scripts`
writes ``kafka-topics.sh`` and ``kafka-acls.sh`` that run the main classes the Kafka
distribution's ``bin/`` scripts run, so a test can run an administrator's commands as a
page prints them.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from twophase.testing.servers import ServerUnavailable

__all__ = [
    "ENV_LIBS",
    "KAFKA_VERSION",
    "POM",
    "TOOLS",
    "KafkaJarsUnavailable",
    "cache_dir",
    "cached_jars",
    "java_binary",
    "kafka_libs",
    "maven_copy",
    "pom_property",
    "tool_scripts",
]

ENV_LIBS = "TWOPHASE_KAFKA_LIBS"
"""A folder of Kafka's jars to use as is (no Maven)."""

POM = Path(__file__).with_name("kafka-broker.pom.xml")


def pom_property(pom: Path, name: str) -> str:
    """The value of ``<name>`` in ``pom`` (a version the pom pins)."""
    found = re.search(rf"<{re.escape(name)}>([^<]+)</{re.escape(name)}>", pom.read_text())
    assert found, f"{pom} names no <{name}>"
    return found.group(1)


KAFKA_VERSION = pom_property(POM, "kafka.version")


class KafkaJarsUnavailable(ServerUnavailable):
    """Kafka's jars are not cached and cannot be resolved (no Maven, no Java, offline)."""


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/twophase`` (``~/.cache/twophase``): where the jars are kept."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "twophase"


def java_binary() -> str:
    """The ``java`` that runs the broker: ``$JAVA_HOME/bin/java`` or PATH's."""
    home = os.environ.get("JAVA_HOME")
    if home and os.access(Path(home) / "bin" / "java", os.X_OK):
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise KafkaJarsUnavailable(
            "java not found: Apache Kafka 4 needs Java 17 or newer "
            "(Debian: apt-get install openjdk-17-jre-headless) or set JAVA_HOME")
    return found


def _has_broker(libs: Path) -> bool:
    return any(libs.glob("kafka_2.13-*.jar")) and any(libs.glob("kafka-clients-*.jar"))


def kafka_libs(timeout: float = 600.0) -> Path:
    """The folder of Kafka's broker jars: ``$TWOPHASE_KAFKA_LIBS``, else the cache,
    built with ``mvn`` the first time."""
    return cached_jars(POM, f"kafka-{KAFKA_VERSION}", "libs", env=ENV_LIBS,
                       ready=_has_broker, lacks="holds no kafka_2.13 and kafka-clients jars",
                       what=f"Apache Kafka {KAFKA_VERSION}'s jars", timeout=timeout)


def cached_jars(pom: Path, cache_name: str, folder: str, *, env: str,
                ready: Callable[[Path], bool], lacks: str, what: str, timeout: float,
                artifacts: Sequence[str] = ()) -> Path:
    """The folder of ``pom``'s jars: ``$env`` when set (refused, saying it ``lacks``, when
    ``ready`` says no), else ``<cache>/<cache_name>-<pom digest>/<folder>``, resolved with
    ``mvn`` the first time under a file lock (parallel callers wait for one build). Keyed
    by the pom's content: a changed pom builds a new folder."""
    explicit = os.environ.get(env)
    if explicit:
        if not ready(Path(explicit)):
            raise KafkaJarsUnavailable(f"${env}={explicit} {lacks}: unset it or fill it")
        return Path(explicit)
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:10]
    root = cache_dir() / f"{cache_name}-{digest}"
    jars = root / folder
    if ready(jars):
        return jars
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready(jars):  # another process built it while this one waited
            maven_copy(pom, root, jars, what=what, env=env, ready=ready, timeout=timeout,
                       artifacts=artifacts)
    return jars


def maven_copy(pom: Path, root: Path, target: Path, *, what: str, env: str,
               ready: Callable[[Path], bool], timeout: float,
               artifacts: Sequence[str] = ()) -> None:
    """``mvn dependency:copy-dependencies`` of ``pom`` (only ``artifacts`` when named)
    into a temporary folder under ``root``, renamed to ``target`` once ``ready`` says it
    is whole: a half-copied folder is never found. Each refusal names the fix (``env``:
    the variable that names a ready folder instead)."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaJarsUnavailable(
            f"{what} are not cached in {target} and mvn is not installed: install Maven "
            f"(Debian: apt-get install maven) and Java 17, or set ${env} to a folder of "
            "those jars")
    java_binary()  # Maven needs it too: the same clear error
    tmp = Path(tempfile.mkdtemp(prefix="jars-", dir=root))
    cmd = [mvn, "-q", "-B", "-f", str(pom), "dependency:copy-dependencies",
           "-DincludeScope=runtime", f"-DoutputDirectory={tmp}"]
    if artifacts:
        cmd.append(f"-DincludeArtifactIds={','.join(artifacts)}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise KafkaJarsUnavailable(f"mvn did not resolve {what} within {timeout}s "
                                   "(is Maven Central reachable?)") from exc
    if done.returncode != 0 or not ready(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        raise KafkaJarsUnavailable(
            f"mvn could not resolve {what} from {pom} (exit {done.returncode}; is Maven "
            f"Central reachable?):\n{(done.stdout + done.stderr)[-3000:]}")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


TOOLS: dict[str, str] = {
    "kafka-topics.sh": "org.apache.kafka.tools.TopicCommand",
    "kafka-acls.sh": "org.apache.kafka.tools.AclCommand",
}
"""The scripts of Kafka 4.x's ``bin/`` and the main class each runs (through
``kafka-run-class.sh``); both classes are in ``kafka-tools-<version>.jar``."""

_TOOLS_LOG4J2 = """status = warn
appender.err.type = Console
appender.err.name = err
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.err.ref = err
"""


def tool_scripts(folder: Path) -> Path:
    """Write :data:`TOOLS` into ``folder`` (made if missing) as executable scripts that
    run Kafka's main class on the resolved jars, with warnings on stderr as the
    distribution's tools log; returns ``folder``, to put first on ``PATH``."""
    libs = kafka_libs()
    if not any(libs.glob("kafka-tools-*.jar")):
        raise KafkaJarsUnavailable(
            f"{libs} holds no kafka-tools jar (Kafka's command-line tools): point "
            f"${ENV_LIBS} at a folder that has it, or unset it to resolve {POM.name}")
    folder.mkdir(parents=True, exist_ok=True)
    log4j = folder / "tools-log4j2.properties"
    log4j.write_text(_TOOLS_LOG4J2)
    java = [java_binary(), "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
            f"-Dlog4j2.configurationFile={log4j}", "-cp", f"{libs}/*"]
    for script, main in TOOLS.items():
        path = folder / script
        path.write_text(f"#!/bin/sh\n# Apache Kafka {KAFKA_VERSION}'s bin/{script}: the same "
                        f"main class, on Maven's jars\nexec {shlex.join(java)} {main} \"$@\"\n")
        path.chmod(0o755)
    return folder


if __name__ == "__main__":  # `python -m twophase.testing.kafkajars`: resolve now (CI)
    print(kafka_libs())
