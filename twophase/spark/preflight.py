"""Before a sink writes anything: can the executors run its tasks?

A sink's tasks run in the executors' Python, which is not the driver's unless someone
said so: Spark starts ``python3`` from the PATH when neither ``PYSPARK_PYTHON`` nor
``spark.pyspark.python`` is set. A missing ``pyarrow`` there used to surface after three
aborted attempts as hundreds of lines of traces. So, once per sink start (cached per
Spark application, interpreter, coordinator and module set), one cheap Spark job runs a
probe on ``defaultParallelism`` tasks, spread over the executors (a ``mapInArrow`` job, so
that its Python workers are the ones the batch's tasks reuse; an RDD job, which needs
nothing but Python, when that one cannot run, to name what is missing); each task imports
twophase, pyarrow and every participant's modules, compares their versions with the
driver's, opens a TCP connection to the coordinator, and reports its host name and
interpreter; then each participant checks its target from there (its
:meth:`~twophase.participant.Participant.probe`: the folder or bucket writable, the
database login and privileges, the Kafka topic), since the executors, not the driver,
write. The reports are grouped per (host, interpreter), so the error names where to look:
:class:`~twophase.errors.EnvironmentProblem` says what is missing and the fix, a target's
refusal is its participant's :class:`~twophase.errors.TargetProblem`.

The probe is compiled from source in a namespace no module owns, so cloudpickle ships it
by value: it runs even on an executor where twophase itself cannot be imported.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from twophase.errors import EnvironmentProblem, TargetProblem
from twophase.participant import Participant

__all__ = ["HostReport", "PreflightReport", "after_unreachable", "check_executors",
           "choose_worker_python", "modules_to_check", "preflight_sink", "probe_targets"]

log = logging.getLogger("twophase.preflight")

BASE_MODULES = ("twophase", "pyarrow")
UNREACHABLE = "cannot reach the coordinator at"
CONNECT_TIMEOUT = 5.0  # seconds for the probe's TCP connection to the coordinator

FIX = (
    "Fix: run the executors with an interpreter that has twophase[spark] and your "
    "participants' packages installed: set PYSPARK_PYTHON=/path/to/venv/bin/python before "
    "the SparkSession starts, or .config('spark.pyspark.python', '/path/to/venv/bin/python')"
    " (this driver runs {driver}). On a cluster, ship a packed virtual environment "
    "(spark-submit --archives venv.tar.gz#venv --conf spark.pyspark.python=./venv/bin/python)"
    " and modules of your own with --py-files."
)

_PROBE_SOURCE = '''
def make_probe(modules, host, port, url, timeout, targets):
    def probe(index, rows):
        import importlib, json, os, socket, sys
        out = {"host": socket.gethostname(), "executable": sys.executable, "pid": os.getpid(),
               "python": "%d.%d.%d" % sys.version_info[:3], "versions": {},
               "problems": [], "coordinator": "", "targets": []}
        for mod in modules:
            try:
                m = importlib.import_module(mod)
            except BaseException as exc:
                out["problems"].append("cannot import %s: %s: %s"
                                       % (mod, type(exc).__name__, exc))
                continue
            out["versions"][mod] = str(getattr(m, "__version__", "") or "")
        try:
            socket.create_connection((host, port), timeout=timeout).close()
        except OSError as exc:
            out["coordinator"] = "%s: %s" % (type(exc).__name__, exc)
        if targets and not out["problems"]:  # each participant checks its target from here
            try:
                import pickle
                parts = pickle.loads(targets)
            except BaseException as exc:
                parts = []
                out["problems"].append("cannot load the participants: %s: %s"
                                       % (type(exc).__name__, exc))
            for part in parts:
                try:
                    part.probe()
                except BaseException as exc:
                    out["targets"].append({"error": type(exc).__name__,
                                           "message": str(exc) or type(exc).__name__,
                                           "participant": part.describe()})
                finally:
                    try:
                        part.close()
                    except BaseException:
                        pass
        yield json.dumps(out)
    return probe


def arrow_probe(probe):
    # The same probe as a mapInArrow function: its tasks run in the Python workers of
    # SQL's Arrow runner, which the batch's mapInArrow tasks reuse (an RDD job's workers
    # are another pool, and starting that second pool cost a restarted job ~1-2 s).
    def run(batches):
        for _ in batches:
            pass
        import pyarrow
        yield pyarrow.RecordBatch.from_pydict({"report": list(probe(0, ()))})
    return run
'''


def _compile_probe(name: str = "make_probe") -> Callable[..., Any]:
    namespace: dict[str, Any] = {"__name__": "twophase_preflight_probe"}  # no such module
    exec(compile(_PROBE_SOURCE, "<twophase preflight probe>", "exec"), namespace)  # noqa: S102
    maker: Callable[..., Any] = namespace[name]
    return maker


@dataclass
class HostReport:
    """What the probe found on one host with one interpreter (one or more tasks)."""

    host: str
    executable: str
    python: str
    tasks: int = 0
    versions: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    targets: list[dict[str, str]] = field(default_factory=list)
    """Participants whose :meth:`~twophase.participant.Participant.probe` failed here:
    ``error`` (its class), ``message``, ``participant``."""
    pids: list[int] = field(default_factory=list)
    """The Python workers that ran the probe (the batch's tasks reuse them)."""


@dataclass
class PreflightReport:
    """Per (host, interpreter) findings of one probe job; ``problems`` empty means OK."""

    hosts: list[HostReport]
    driver_executable: str
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not any(h.problems or h.targets for h in self.hosts)

    def target_problem(self) -> TargetProblem | None:
        """The executors reached the participants' targets and one refused for good: its
        sentence first, then any other host's."""
        found = [t["message"] for h in self.hosts for t in h.targets
                 if t["error"] == TargetProblem.__name__]
        unique = list(dict.fromkeys(found))
        return TargetProblem("\n".join(unique)) if unique else None

    def message(self, sink: str) -> str:
        lines = [f"sink {sink!r}: the executors cannot run this sink's tasks (checked before "
                 "anything was written):"]
        for h in self.hosts:
            if h.problems:
                lines.append(f"  on host {h.host}, interpreter {h.executable} "
                             f"(Python {h.python}, {h.tasks} task(s)):")
                lines.extend(f"    - {p}" for p in h.problems)
            if h.targets:
                lines.append(f"  on host {h.host}, a participant cannot use its target:")
                lines.extend(f"    - {t['participant']}: {t['error']}: {t['message']}"
                             for t in h.targets)
        # the interpreter fix; reachability and targets name their own
        if any(h.problems for h in self.hosts) and not self.only_unreachable:
            lines.append(FIX.format(driver=self.driver_executable))
        return "\n".join(lines)

    @property
    def only_unreachable(self) -> bool:
        """Every problem is the coordinator not answering (the executors' Python is fine)."""
        problems = [p for h in self.hosts for p in h.problems]
        return bool(problems) and all(p.startswith(UNREACHABLE) for p in problems)


def modules_to_check(participants: Sequence[Participant]) -> tuple[str, ...]:
    """twophase, pyarrow, each participant's own module and what it says it needs."""
    from pyspark import cloudpickle

    by_value: set[str] = cloudpickle.list_registry_pickle_by_value()  # type: ignore[no-untyped-call]
    out = list(BASE_MODULES)
    for p in participants:
        mod = type(p).__module__
        # __main__ code is shipped by value, as is a module the user registered so: no
        # install needed on the executors
        names = [] if mod == "__main__" or mod in by_value else [mod]
        names.extend(p.required_modules())
        out.extend(n for n in names if n not in out)
    return tuple(out)


def _driver_versions(modules: Iterable[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for mod in modules:
        try:
            out[mod] = str(getattr(importlib.import_module(mod), "__version__", "") or "")
        except ImportError:
            out[mod] = ""
    return out


def _mismatch(mod: str, driver: str, executor: str) -> str | None:
    """twophase must be the driver's own version (one protocol); other modules the same
    major version (data crosses the boundary in their formats)."""
    if not driver or not executor or driver == executor:
        return None
    if mod == "twophase" or mod.startswith("twophase."):
        return f"{mod} {executor} here but {driver} on the driver: install the same version"
    if driver.split(".")[0] != executor.split(".")[0]:
        return (f"{mod} {executor} here but {driver} on the driver: install a "
                f"{driver.split('.')[0]}.x release")
    return None


def choose_worker_python(sc: Any) -> str:
    """The interpreter the sink's tasks will run in; in local mode with neither
    ``PYSPARK_PYTHON`` nor ``spark.pyspark.python`` set, the driver's own (the PATH's
    ``python3`` is rarely the venv the job was started from). ``spark.pyspark.python``
    set on the session is honoured too (pip-installed PySpark reads only the variable)."""
    if os.environ.get("PYSPARK_PYTHON"):
        return str(sc.pythonExec)
    conf = sc.getConf().get("spark.pyspark.python", None)
    if conf:
        if sc.pythonExec != conf:
            sc.pythonExec = conf
            log.info("executors use spark.pyspark.python=%s", conf)
        return str(conf)
    if str(sc.master).startswith("local") and sc.pythonExec != sys.executable:
        sc.pythonExec = sys.executable
        log.info("local mode and neither PYSPARK_PYTHON nor spark.pyspark.python is set: "
                 "the executors use the driver's interpreter %s", sys.executable)
    return str(sc.pythonExec)


_CACHE: dict[tuple[Any, ...], PreflightReport] = {}


def probe_targets(participants: Sequence[Participant], sink: str | None = None,
                  client: Any = None) -> None:
    """Each participant checks its target from this process (the driver), before the
    executors do: a refusal here needs no Spark job to be named. Given the sink and its
    coordinator ``client`` (a sink starting), then :func:`clear_lingering`."""
    for p in participants:
        p.probe()
    if sink is not None and client is not None:
        clear_lingering(client, sink, participants)


def clear_lingering(client: Any, sink: str, participants: Sequence[Participant]) -> None:
    """Once per sink start, before the first batch: a participant that can find what a
    crash left open on its target (Kafka's open transactions, which stall every
    ``read_committed`` reader until the broker's timeout) clears it now, sparing what
    the coordinator (``client``) holds as COMMIT-decided. Cannot list them: a warning,
    not a failure (the next ``init_transactions`` or the broker's timeout ends them)."""
    for p in participants:
        try:
            cleared = p.clear_left_open(sink, client)
        except Exception as exc:  # a clean-up: never the reason a sink cannot start
            log.warning("sink %s: %s: cannot look for transactions a crash left open "
                        "(%s: %s); `twophase resolve %s` clears them later", sink, p.name,
                        type(exc).__name__, exc, sink)
            continue
        if cleared:
            log.warning(
                "sink %s: %s: aborted %d transaction(s) a crash left open (%s; oldest "
                "%.0fs): readers of %s were stalled behind them", sink,
                p.name, len(cleared), ", ".join(t.name for t in cleared),
                max(t.age_s for t in cleared),
                ", ".join(sorted({h for t in cleared for h in t.holds})))


def _targets(participants: Sequence[Participant]) -> bytes:
    """The participants, pickled once for the probe tasks (by cloudpickle: a participant
    class defined in the job script travels by value, as it does for the batch's tasks)."""
    from pyspark import cloudpickle

    return bytes(cloudpickle.dumps(list(participants)))  # type: ignore[no-untyped-call]


def preflight_sink(
    sc: Any, session: Any, sink: str, participants: Sequence[Participant],
    coordinator_url: str, *, executors: bool, wait_s: float, client: Any = None,
) -> None:
    """Once per sink start: each target from the driver (no job needed to say why) and
    what a crash left open on it (:func:`clear_lingering`, given the coordinator's
    ``client``), the executors' interpreter, then (``executors``) the probe job that
    checks it can run the sink's tasks. ``sc`` is None under Spark Connect: no
    SparkContext, no probe job."""
    probe_targets(participants, sink, client)
    if sc is None:
        log.info("sink %s: Spark Connect, the executors' preflight is skipped", sink)
        return
    choose_worker_python(sc)
    if executors:
        check_executors(sc, sink, participants, coordinator_url, wait_s=wait_s,
                        session=session)


def check_executors(
    sc: Any, sink: str, participants: Sequence[Participant], coordinator_url: str,
    *, wait_s: float = 0.0, session: Any = None,
) -> PreflightReport:
    """Run the probe job (once per application, interpreter, coordinator and module set);
    raise :class:`EnvironmentProblem` when any executor cannot run the sink's tasks.

    A coordinator the driver cannot reach either is an outage (a daemon restarting), not
    the executors' environment: the probe is run again for up to ``wait_s`` seconds (the
    sink's retry budget) before that is reported.

    With a ``session`` (the batch's SparkSession) the probe runs as a ``mapInArrow`` job,
    in the Python workers the batch's tasks will reuse; only if that job cannot run at all
    is it run again as an RDD job, which needs nothing but Python on the executors and so
    can name what is missing (pyarrow, twophase)."""
    choose_worker_python(sc)
    modules = modules_to_check(participants)
    targets = _targets(participants)
    key = (sc.applicationId, sc.pythonExec, coordinator_url, modules, targets)
    report = _CACHE.get(key)
    deadline = time.monotonic() + wait_s
    rechecked = warned = False
    while report is None:
        report = _probe(sc, modules, coordinator_url, targets, session)
        if report.ok:
            _CACHE[key] = report
            log.info("sink %s: executors checked in %.1fs: %s", sink, report.seconds,
                     ", ".join(f"{h.host} ({h.executable}, {h.tasks} task(s))"
                               for h in report.hosts))
        elif report.only_unreachable and time.monotonic() < deadline:
            step = after_unreachable(_reachable(coordinator_url), rechecked)
            if step == "report":
                break
            if step == "wait" and not warned:
                log.warning("sink %s: the coordinator at %s does not answer the driver "
                            "either (an outage?): checking the executors again for up "
                            "to %.0fs", sink, coordinator_url, wait_s)
                warned = True
            if step == "wait":
                time.sleep(1.0)
            rechecked = step == "again"
            report = None
    if not report.ok:
        refused = report.target_problem()
        if refused is not None:
            raise refused
        raise EnvironmentProblem(report.message(sink))
    return report


def after_unreachable(driver_reaches: bool, rechecked: bool) -> str:
    """What follows a probe whose only problem is an unreachable coordinator: ``wait``
    (the driver cannot reach it either: an outage, probe again after a pause), ``again``
    (the driver reaches it: it may have come back between the executors' probe and the
    driver's check, a daemon restarting, so probe once more) or ``report`` (the driver
    reaches it and the executors still did not after a second probe: their network)."""
    if not driver_reaches:
        return "wait"
    return "report" if rechecked else "again"


def _reachable(url: str) -> bool:
    """Whether the driver can open a TCP connection to the coordinator."""
    import socket

    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT):
            return True
    except OSError:
        return False


WORKER_CRASHED: Final = "Python worker exited unexpectedly"
"""Spark's words for a Python worker that died under its task (a signal, a crash)."""
CRASH_RETRIES: Final = 2
"""Probes run again after a crashed worker before the crash is reported as the cause."""


def _probe(sc: Any, modules: tuple[str, ...], url: str, targets: bytes = b"",
           session: Any = None) -> PreflightReport:
    import json

    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    n = max(1, int(sc.defaultParallelism))
    probe = _compile_probe()(modules, host, port, url, CONNECT_TIMEOUT, targets)
    started = time.perf_counter()
    rows: list[str] | None = None
    if session is not None:
        try:
            job = session.range(0, n, 1, n).mapInArrow(
                _compile_probe("arrow_probe")(probe), "report string")
            rows = [r["report"] for r in job.collect()]
        except Exception as exc:  # diagnosed by the RDD probe below, which needs less
            log.debug("the Arrow probe job failed (%s); probing again without Arrow",
                      _spark_cause(exc))
    for tries_left in reversed(range(CRASH_RETRIES + 1)):
        try:
            if rows is None:
                rows = sc.parallelize(range(n), n).mapPartitionsWithIndex(probe).collect()
            break
        except Exception as exc:  # the workers did not even start: name what Spark said
            cause = _spark_cause(exc)
            if tries_left and WORKER_CRASHED in cause:
                # a worker killed under the probe (an OOM killer, a node going away; a
                # chaos run's kill did this) is not the environment: probe again, and only
                # a crash every time is reported
                log.warning("a probe task's Python worker crashed (%s); probing again",
                            cause.splitlines()[0][:300])
                continue
            raise EnvironmentProblem(
                f"the executors' Python ({sc.pythonExec}) could not run a probe task: "
                f"{cause}\n" + FIX.format(driver=sys.executable)
            ) from None
    assert rows is not None  # the loop above either set them or raised
    seconds = time.perf_counter() - started
    driver = _driver_versions(modules)
    grouped: dict[tuple[str, str], HostReport] = {}
    for raw in rows:
        r = json.loads(raw)
        h = grouped.setdefault(
            (r["host"], r["executable"]), HostReport(r["host"], r["executable"], r["python"])
        )
        h.tasks += 1
        h.pids.append(int(r.get("pid", 0)))
        h.versions.update(r["versions"])
        found = list(r["problems"])
        for mod, version in r["versions"].items():
            bad = _mismatch(mod, driver.get(mod, ""), version)
            if bad:
                found.append(bad)
        if r["coordinator"]:
            found.append(_unreachable(url, host, r["coordinator"]))
        h.problems.extend(p for p in found if p not in h.problems)
        h.targets.extend(t for t in r.get("targets", []) if t not in h.targets)
    return PreflightReport(sorted(grouped.values(), key=lambda h: (h.host, h.executable)),
                           sys.executable, seconds)


def _unreachable(url: str, host: str, cause: str) -> str:
    hint = ("an embedded coordinator listens on 127.0.0.1 only under a local master or "
            "when TWOPHASE_EMBEDDED_HOST / the sink's coordinator_host= say so; on a "
            "cluster it listens on spark.driver.host, which must be an address the "
            "executors reach (docs/cluster.md)"
            if host in ("127.0.0.1", "localhost", "::1")
            else "check the host name, port and firewall between executors and coordinator")
    return f"{UNREACHABLE} {url} ({cause}): {hint}"


def _spark_cause(exc: BaseException) -> str:
    """The line of a Spark/Py4J error that says why the Python worker failed."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for marker in ("PYTHON_VERSION_MISMATCH", "Cannot run program", "Error:", "Exception:"):
        for ln in _skip_py4j(lines):
            if marker in ln:
                return ln[:500]
    return (lines or [type(exc).__name__])[0][:500]


def _skip_py4j(lines: list[str]) -> Iterator[str]:
    return (ln for ln in lines if not ln.startswith(("An error occurred while calling",
                                                     "py4j.protocol.Py4JJavaError")))
