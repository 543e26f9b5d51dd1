"""Kafka participant (see :mod:`.participant` for how a branch maps onto Kafka).

Modules, one concern each:

- ``config``: which librdkafka settings a user may pass, and the defaults;
- ``errors``: what a librdkafka error means for a branch (retry or report);
- ``admin``: driver-side checks of columns, brokers and topic;
- ``participant``: the participant contract, each hook sent to its prepare mode's path;
- ``resumable``: the default prepare, the task's own transaction left open and ended by
  the driver with ``EndTxn`` (``txnwire``: the requests on Kafka's wire);
- ``staged``: the staged prepare, staged in the task and copied by the driver;
- ``legacy``: a branch voted by the in-task prepare retired in 0.4, ended after the upgrade;
- ``marker``: the branch's marker (its marker group's committed offset), read;
- ``records``: rows as Kafka records (key, value, headers, size limit), produced;
- ``producers``: a branch's transactional producer, made, kept or closed;
- ``options``: the participant's options, checked and written to its descriptor;
- ``clients``: this process's idle producers and marker consumers;
- ``readback``: the topic read as a ``read_committed`` consumer (for the verifier).
"""

from twophase.sinks.kafka.config import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TRANSACTION_MAX_TIMEOUT_MS,
    RECORD_OVERHEAD_BYTES,
    validate_config,
    validate_topic,
)
from twophase.sinks.kafka.errors import classify_commit_error
from twophase.sinks.kafka.participant import KafkaParticipant

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_TRANSACTION_MAX_TIMEOUT_MS",
    "RECORD_OVERHEAD_BYTES",
    "KafkaParticipant",
    "classify_commit_error",
    "validate_config",
    "validate_topic",
]
