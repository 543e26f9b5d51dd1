"""The prepare job's function is pickled and handed to the JVM once, not per batch
(``twophase.spark.compat.ArrowMap``): what a batch then costs the driver is one py4j
round trip to map its DataFrame, and the rows the tasks see are the batch's own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

from twophase.spark.compat import ArrowMap
from twophase.spark.preflight import choose_worker_python

pytestmark = pytest.mark.spark


def _seen(df: Any) -> tuple[int, set[str]]:
    got = df.collect()
    return sum(r["rows"] for r in got), {r["names"] for r in got if r["names"]}


def test_one_pickle_for_every_batch_and_one_more_for_new_columns(spark: Any) -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    choose_worker_python(spark.sparkContext)  # the driver's interpreter, as a sink's
    pickled: list[int] = []  # the driver's pickles of the function

    class Counted:  # made here, so Spark's workers get it by value
        def __reduce__(self) -> tuple[Any, ...]:
            pickled.append(1)
            return (Counted, ())

        def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            rows, names = 0, ""
            for b in batches:
                rows += b.num_rows
                names = ",".join(b.schema.names)
            yield pa.RecordBatch.from_pylist([{"rows": rows, "names": names}])

    mapped = ArrowMap(Counted(), StructType([StructField("rows", LongType()),
                                              StructField("names", StringType())]))
    assert _seen(mapped(spark.range(5))) == (5, {"id"})
    assert _seen(mapped(spark.range(3).filter("id > 0"))) == (2, {"id"})
    assert len(pickled) == 1  # the second batch reused the first one's function
    # other columns, names that need quoting: a new function, the batch's own columns
    odd = spark.range(4).selectExpr("id AS `a.b`", "id * 2 AS `c``d`")
    assert _seen(mapped(odd)) == (4, {"a.b,c`d"})
    assert len(pickled) == 2
