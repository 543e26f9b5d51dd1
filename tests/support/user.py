"""Running a program as a user runs it: a plain interpreter and the user's environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import twophase
from twophase.testing.servers import clean_env

INTERNAL = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "PYTHONPATH", "SPARK_LOCAL_IP")
"""Variables a user does not set: Spark's interpreter choice, and the suite's own."""


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
