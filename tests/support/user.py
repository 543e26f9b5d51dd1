"""Running a program as a user runs it: a plain interpreter and the user's environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import twophase
from twophase.testing.servers import clean_env

INTERNAL = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH", "SPARK_LOCAL_IP",
            "JDK_JAVA_OPTIONS")
"""Variables a user does not set: Spark's interpreter choice, and the suite's own (the
JVM options of tests/conftest.py: a user's JVMs run as Java starts them)."""


def user_env() -> dict[str, str]:
    """The environment a user has: no Spark or twophase variables. PYTHONPATH only when
    the interpreter would otherwise import another checkout of twophase than this one
    (a development worktree; in CI the package is installed editable)."""
    env = {k: v for k, v in clean_env().items()
           if k not in INTERNAL and not k.startswith("TWOPHASE_")}
    ours = str(Path(twophase.__file__).resolve().parent)
    found = subprocess.run(
        [sys.executable, "-c", "import twophase, os; print(os.path.dirname(twophase.__file__))"],
        env=env, cwd="/", capture_output=True, text=True, timeout=60, check=False,
    ).stdout.strip()
    if found != ours:
        env["PYTHONPATH"] = str(Path(ours).parent)
    return env


def run_reference_job(
    cfg_path: Path, env_extra: dict[str, str], log: Path,
    *, drop: tuple[str, ...] = ("PYSPARK_PYTHON",),
) -> subprocess.CompletedProcess[str]:
    """The reference job (``python -m twophase.testing.job CONFIG``) as its own driver
    process, so that a failpoint can SIGKILL it: this environment without any failpoint
    variable or ``drop``, plus ``env_extra``; stderr appended to ``log``."""
    import os

    from twophase import failpoints

    env = {k: v for k, v in os.environ.items()
           if k not in (failpoints.ENV, failpoints.ONCE_DIR_ENV, *drop)}
    env.update(env_extra)
    with open(log, "a") as err:
        return subprocess.run([sys.executable, "-m", "twophase.testing.job", str(cfg_path)],
                              env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=600, check=False)
