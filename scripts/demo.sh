#!/usr/bin/env bash
# The main job from nothing: a virtual environment with twophase[all], then `twophase demo`.
# Arguments go to `twophase demo` (e.g. `bash scripts/demo.sh --batches 20`).
# Each step says what it does; pip shows what it collects (a few minutes the first time).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TWOPHASE_VENV:-.venv}"
PY="${PYTHON:-python3}"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v java >/dev/null 2>&1; then
  echo "== [0/3] installing a Java runtime for Spark (java not found)"
  as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq openjdk-17-jre-headless
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "== [1/3] creating the virtual environment $VENV"
  "$PY" -m venv "$VENV"
else
  echo "== [1/3] using the virtual environment $VENV"
fi
echo "== [2/3] installing twophase[all] into $VENV (pyspark, pyarrow, the participants' clients; a few minutes the first time)"
"$VENV/bin/python" -m pip install -q --upgrade pip
# setuptools' build warnings (the editable install's notice) say nothing to a demo's user
PYTHONWARNINGS=ignore "$VENV/bin/python" -m pip install --progress-bar off -e ".[all]" \
  | { grep -v '^Requirement already satisfied' || true; }
echo "== [3/3] twophase demo: a private PostgreSQL, Spark in local mode, the embedded coordinator"
exec "$VENV/bin/twophase" demo "$@"
