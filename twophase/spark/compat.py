"""Which Spark the sink runs on, in one place: the versions it accepts and each API a
version range lacks, detected and named here, never by version tests spread over the
modules (docs/user/compatibility.md).

The sink runs on Spark 3.5 and 4.x. What it needs, and since when Spark has it:

- ``DataFrame.mapInArrow``: the prepare job (Spark 3.3);
- ``foreachBatch`` under Spark Connect: Spark 3.5.0 (SPARK-42944), the floor, which is
  also the oldest release the suite runs on;
- ``to_arrow_schema(schema, timezone=)``: pyspark 4.2. Older ones say UTC for every
  timestamp while the JVM hands ``mapInArrow`` the session's zone, so the zone is set
  here (:func:`arrow_schema_of`), found by the call's signature;
- a ``mapInArrow`` function pickled once for every batch (:class:`ArrowMap`): the JVM's
  ``Dataset.mapInArrow(Column, boolean, ResourceProfile)`` of Spark 4.x, found by calling
  it; elsewhere (3.5, Spark Connect) the public ``DataFrame.mapInArrow``.

The Python side (``pyspark``) and the JVM (``spark.version``) must be the same minor
release: a pyspark 4 client in a venv packed for a Spark 3.5 platform fails inside
Spark's own Python worker protocol, after the coordinator was asked to begin.
"""

from __future__ import annotations

import inspect
import re
from functools import cache
from typing import Any

from twophase.errors import EnvironmentProblem

__all__ = ["SPARK_FLOOR", "ArrowMap", "arrow_schema_of", "check_spark", "in_zone", "spark_version",
           "zone_of"]

SPARK_FLOOR = (3, 5)
"""The oldest Spark release the sink runs on (Connect's ``foreachBatch``: 3.5.0; the
suite's Spark 3.5 job runs the sink there)."""


def spark_version(text: str) -> tuple[int, int]:
    """``"3.5.9"``, ``"4.1.0-SNAPSHOT"``, ``"3.5.1-amzn-0"`` -> (major, minor)."""
    found = re.match(r"(\d+)\.(\d+)", text.strip())
    if found is None:
        raise EnvironmentProblem(
            f"cannot read a Spark version from {text!r}: the sink needs Spark "
            f"{SPARK_FLOOR[0]}.{SPARK_FLOOR[1]} or newer. Fix: run on a Spark release whose "
            "version reads MAJOR.MINOR[.PATCH]")
    return int(found.group(1)), int(found.group(2))


def check_spark(sink: str, jvm: str, python: str) -> None:
    """Refuse, before anything is begun or written, a Spark the sink cannot run on:
    ``jvm`` is the session's ``spark.version``, ``python`` the driver's
    ``pyspark.__version__``."""
    spark, client = spark_version(jvm), spark_version(python)
    floor = f"{SPARK_FLOOR[0]}.{SPARK_FLOOR[1]}"
    if spark < SPARK_FLOOR:
        raise EnvironmentProblem(
            f"sink {sink!r}: Spark {jvm} is too old: the sink runs in foreachBatch under Spark "
            f"Connect, added in Spark {floor}.0, and is tested from there. Fix: run on "
            f"Spark {floor} or 4.x (docs/user/compatibility.md)")
    if client != spark:
        raise EnvironmentProblem(
            f"sink {sink!r}: pyspark {python} talks to Spark {jvm}: Python and JVM sides of "
            "Spark must be the same release (a venv packed with another pyspark than the "
            f"platform's). Fix: install pyspark=={jvm.split('-')[0]} (twophase[spark] "
            f"accepts {floor} and 4.x), or leave pyspark out of the packed venv and use "
            "the platform's")


@cache
def _zone_argument() -> bool:
    """Whether this pyspark's ``to_arrow_schema`` takes ``timezone=`` (4.2+)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return "timezone" in inspect.signature(to_arrow_schema).parameters


def arrow_schema_of(schema: Any, tz: str | None) -> Any:
    """The Arrow schema ``mapInArrow`` hands the tasks for the Spark ``schema``:
    timestamps in the session's zone ``tz``, as the JVM writes them."""
    from pyspark.sql.pandas.types import to_arrow_schema

    if _zone_argument():
        return to_arrow_schema(schema, timezone=tz)
    return in_zone(to_arrow_schema(schema), tz)


def in_zone(schema: Any, tz: str | None) -> Any:
    """``schema`` with its timestamps' zone set to ``tz`` (nested ones too); pyspark
    before 4.2 says UTC."""
    import pyarrow as pa

    def fix(t: Any) -> Any:
        if pa.types.is_timestamp(t) and t.tz is not None:
            return pa.timestamp(t.unit, tz=tz)
        if pa.types.is_struct(t):
            return pa.struct([f.with_type(fix(f.type)) for f in t])
        if pa.types.is_large_list(t):
            return pa.large_list(t.value_field.with_type(fix(t.value_type)))
        if pa.types.is_list(t):
            return pa.list_(t.value_field.with_type(fix(t.value_type)))
        if pa.types.is_map(t):
            return pa.map_(t.key_field.with_type(fix(t.key_type)),
                           t.item_field.with_type(fix(t.item_type)))
        return t

    return pa.schema([f.with_type(fix(f.type)) for f in schema], metadata=schema.metadata)


def zone_of(schema: Any) -> str | None:
    """The zone of ``schema``'s first zoned timestamp (nested ones too): the session
    zone Spark wrote its Arrow batches in; None when it has none."""
    import pyarrow as pa

    def walk(t: Any) -> str | None:
        if pa.types.is_timestamp(t):
            return t.tz  # type: ignore[no-any-return]
        return next((z for i in range(t.num_fields) if (z := walk(t.field(i).type))), None)

    return next((z for f in schema if (z := walk(f.type))), None)


_COLUMN_MAP: dict[str, bool] = {}  # "ok": whether Dataset.mapInArrow takes a Column here


class ArrowMap:
    """``df.mapInArrow(func, schema)`` for every batch, with ``func``
    pickled and handed to the JVM once.

    ``DataFrame.mapInArrow`` makes a new UDF per call: it pickles the function (the task's
    closure holds the sink's participants), builds the JVM's Python function and UDF and
    resolves each column, ~30 py4j round trips a batch. Here the UDF, applied to the
    columns by name, is made once per SparkContext and column list; each batch costs one
    round trip (``Dataset.mapInArrow(Column, boolean, ResourceProfile)``), which analyses
    the batch's plan as before. A pickled function over Spark's broadcast threshold stays
    one broadcast. Where that JVM method is not there (Spark 3.5 takes a PythonUDF; Spark
    Connect has no JVM here) this is the public ``mapInArrow``, as before."""

    def __init__(self, func: Any, schema: Any) -> None:
        self.func, self.schema = func, schema
        self._mapped: tuple[Any, tuple[str, ...], Any] | None = None  # (jsc, names, Column)

    def __call__(self, df: Any) -> Any:
        jdf = getattr(df, "_jdf", None)
        if jdf is None or not _COLUMN_MAP.get("ok", True):
            return df.mapInArrow(self.func, self.schema)
        from py4j.protocol import Py4JError, Py4JJavaError
        from pyspark.sql import DataFrame  # as pyspark's own mapInArrow makes it

        session = df.sparkSession
        jsc = session.sparkContext._jsc
        names = tuple(df.columns)
        try:
            if self._mapped is None or self._mapped[0] is not jsc or self._mapped[1] != names:
                self._mapped = (jsc, names, self._column(names))
            mapped = jdf.mapInArrow(self._mapped[2], False, None)  # no barrier stage
        except (ImportError, Py4JError) as exc:
            if isinstance(exc, Py4JJavaError) or (isinstance(exc, Py4JError)
                                                  and "does not exist" not in str(exc)):
                raise  # Spark refused the plan, or the JVM is gone: its own error
            _COLUMN_MAP["ok"] = False  # not this pyspark or JVM method: the public one
            return df.mapInArrow(self.func, self.schema)
        _COLUMN_MAP["ok"] = True
        return DataFrame(mapped, session)

    def _column(self, names: tuple[str, ...]) -> Any:
        """The UDF applied to ``names``, unresolved (a JVM Column): each batch's plan
        resolves them by name as ``df[name]`` would; quoted, so a dot is part of a name."""
        from pyspark.sql.functions import col
        from pyspark.sql.pandas.functions import pandas_udf
        from pyspark.util import PythonEvalType

        make: Any = pandas_udf  # as mapInArrow calls it (an overload pyspark leaves untyped)
        udf = make(self.func, returnType=self.schema,
                   functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF)
        return udf(*[col("`" + n.replace("`", "``") + "`") for n in names])._jc
