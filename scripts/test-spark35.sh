#!/usr/bin/env bash
# The Spark 3.5 job (issue 33): the sink's Spark tests listed in tests/spark35.txt, run on
# pyspark 3.5 in a virtual environment of its own. The default suite (scripts/test.sh)
# stays on pyspark 4.x; scripts/test.sh runs this after it, and it runs alone as
# `bash scripts/test-spark35.sh` (extra arguments go to pytest;
# `TWOPHASE_SPARK35_LONG=1` adds the list's long tests: driver kills in stateful
# queries, the chaos runner's short run).
#
# The environment is made once into ${TWOPHASE_CACHE:-~/.cache/twophase}/spark35-venv-*
# (keyed by the pyspark release and pyproject.toml): pyspark[connect] 3.5, which pins
# numpy below 2, so pyarrow is held below 26 (pyarrow 26 needs numpy 2), and twophase's
# every extra. twophase itself is installed editable from this checkout at each run.
# Needs what scripts/test.sh installs first (Java, PostgreSQL, Maven's Kafka jars).
set -euo pipefail
cd "$(dirname "$0")/.."

SPARK35="${TWOPHASE_SPARK35:-3.5.9}"
PY="${PYTHON:-python3}"
CACHE="${TWOPHASE_CACHE:-$HOME/.cache/twophase}"
KEY="$(sha256sum < pyproject.toml | cut -c1-10)"
VENV="$CACHE/spark35-venv-pyspark$SPARK35-$KEY"

if [ ! -f "$VENV/.complete" ]; then
  echo "== creating $VENV (pyspark $SPARK35, cached after the first run)"
  rm -rf "$VENV"
  mkdir -p "$CACHE"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  constraints="$(mktemp)"
  printf 'pyspark==%s\npyarrow<26\n' "$SPARK35" > "$constraints"
  "$VENV/bin/python" -m pip install -q -c "$constraints" -e ".[all,dev]"
  rm -f "$constraints"
  touch "$VENV/.complete"
fi
# this checkout's twophase (the cached environment may have been made from another one)
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -c 'import pyspark, pyarrow, numpy; print("== Spark 3.5 job: pyspark",
  pyspark.__version__, "pyarrow", pyarrow.__version__, "numpy", numpy.__version__)'

# the subset: one test id per line of tests/spark35.txt (comments say why each is there);
# the "long:" lines only with TWOPHASE_SPARK35_LONG=1
if [ "${TWOPHASE_SPARK35_LONG:-0}" = 1 ]; then long='s/^long:\s*//'; else long='/^long:/d'; fi
mapfile -t tests < <(grep -v '^\s*#' tests/spark35.txt | sed -e "$long" -e '/^\s*$/d')
set +e
"$VENV/bin/python" -m pytest -p no:cacheprovider "${tests[@]}" "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "pytest collected no tests on Spark 3.5: that is a failure here" >&2
  exit 1
fi
exit "$rc"
