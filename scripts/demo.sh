#!/usr/bin/env bash
# The main job from nothing: a virtual environment with twophase[all], then `twophase demo`.
# Arguments go to `twophase demo` (e.g. `bash scripts/demo.sh --batches 20`).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TWOPHASE_VENV:-.venv}"
PY="${PYTHON:-python3}"
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v java >/dev/null 2>&1; then
  echo "== installing a Java runtime for Spark (java not found)"
  as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq openjdk-17-jre-headless
fi
if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[all]"
exec "$VENV/bin/twophase" demo "$@"
