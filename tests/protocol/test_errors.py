"""One exception root: every error class twophase defines derives from TwophaseError,
each code names one class, and the HTTP mapping is read from the class."""

from __future__ import annotations

import importlib
import pkgutil

import twophase
from twophase.errors import (
    CoordinatorError,
    InvalidRequest,
    StaleEpoch,
    TransactionNotFound,
    TwophaseError,
    error_class,
)


def _all_error_classes() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(twophase.__path__, "twophase."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, BaseException)
                    and obj.__module__ == module.__name__):
                found.append(obj)
    return found


def test_every_error_class_has_the_one_root() -> None:
    classes = _all_error_classes()
    assert len(classes) >= 20, classes  # the walk reached sinks, coordinator and tooling
    strays = [f"{c.__module__}.{c.__qualname__}" for c in classes
              if not issubclass(c, TwophaseError)]
    assert not strays, strays


def _subclasses(cls: type[TwophaseError]) -> list[type[TwophaseError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_subclasses(sub))
    return out


def test_each_public_code_names_one_class_and_maps_back() -> None:
    _all_error_classes()  # import everything, so every subclass is known
    public = [c for c in _subclasses(TwophaseError) if not c.__name__.startswith("_")]
    codes = [c.code for c in public if "code" in vars(c)]
    assert len(codes) == len(set(codes)), sorted(codes)
    for cls in public:
        if "code" in vars(cls) and cls is not TwophaseError:
            assert error_class(cls.code) is cls, cls


def test_the_http_mapping_is_read_from_the_class() -> None:
    assert (StaleEpoch.http_status, StaleEpoch.code) == (409, "stale_epoch")
    assert (TransactionNotFound.http_status, TransactionNotFound.code) == (404, "not_found")
    assert (InvalidRequest.http_status, InvalidRequest.code) == (422, "invalid_request")
    assert issubclass(InvalidRequest, ValueError)  # callers may still catch ValueError
    err = error_class("something_new")("refused", status=418, code="something_new")
    assert type(err) is CoordinatorError and err.status == 418 and err.code == "something_new"


def test_a_failed_spark_job_is_named_by_the_jvms_reason_not_py4js_first_line() -> None:
    """Py4J's first line ("An error occurred while calling o280.collectToPython.") says
    nothing: the batch's error leads with the JVM's exception line instead."""
    from twophase.engine.report import short_error

    text = (
        "An error occurred while calling o280.collectToPython.\n"
        ": org.apache.spark.SparkException: Job aborted due to stage failure: Barrier "
        "execution mode does not allow run a barrier stage that requires more slots than "
        "the total number of slots in the cluster currently.\n"
        "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages("
        "DAGScheduler.scala:2)\n"
    )
    got = short_error(Exception(text))
    assert got.startswith("SparkException: Job aborted due to stage failure: Barrier")
    assert "An error occurred while calling" not in got
