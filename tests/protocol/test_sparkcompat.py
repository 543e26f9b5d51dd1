"""Spark 3.5 and 4.x (issue 33): the versions the sink accepts and refuses, each refusal
naming the version, the cause and the fix (twophase.spark.compat)."""

from __future__ import annotations

import pyarrow as pa
import pyspark
import pytest
from pyspark.sql.types import StructField, StructType, TimestampType

from twophase.errors import EnvironmentProblem
from twophase.spark.compat import arrow_schema_of, check_spark, spark_version


@pytest.mark.parametrize("text,want", [("3.5.9", (3, 5)), ("4.1.0-SNAPSHOT", (4, 1)),
                                       ("3.5.1-amzn-0", (3, 5)), ("4.3.0", (4, 3))])
def test_versions_read_as_platforms_spell_them(text: str, want: tuple[int, int]) -> None:
    assert spark_version(text) == want


@pytest.mark.parametrize("jvm", ["3.5.0", "3.5.9", "3.5.1-amzn-0", "4.0.1", "4.3.0"])
def test_spark_35_and_4x_are_accepted(jvm: str) -> None:
    check_spark("orders", jvm, jvm.split("-")[0])


def test_spark_34_is_refused_naming_the_version_the_cause_and_the_fix() -> None:
    with pytest.raises(EnvironmentProblem) as err:
        check_spark("orders", "3.4.4", "3.4.4")
    msg = str(err.value)
    assert "Spark 3.4.4 is too old" in msg and "foreachBatch under Spark Connect" in msg
    assert "Fix: run on Spark 3.5 or 4.x" in msg


def test_a_pyspark_of_another_release_than_the_platforms_spark_is_refused() -> None:
    # a venv packed with pyspark 4 shipped to a Spark 3.5 platform (EMR 7.x)
    with pytest.raises(EnvironmentProblem) as err:
        check_spark("orders", "3.5.1-amzn-0", "4.3.0")
    msg = str(err.value)
    assert "pyspark 4.3.0 talks to Spark 3.5.1-amzn-0" in msg
    assert "Fix: install pyspark==3.5.1" in msg


def test_this_pyspark_hands_the_tasks_timestamps_in_the_session_zone() -> None:
    # whichever pyspark runs the suite (4.x by default, 3.5 in scripts/test.sh's 3.5 job)
    schema = StructType([StructField("ts", TimestampType())])
    got = arrow_schema_of(schema, "Asia/Tokyo")
    assert got.field("ts").type == pa.timestamp("us", tz="Asia/Tokyo"), pyspark.__version__
