"""The Kafka ACLs the participant's principal needs on a cluster that enforces them.

One list, so the user guide (docs/user/security.md), the probe's refusals and the test
that runs a job as a least-privileged user cannot disagree. Names only (strings, not
confluent_kafka's enums): readable without the client installed.
"""

from __future__ import annotations

from dataclasses import dataclass

from twophase.sinks.kafka.staged import default_staging_topic

__all__ = ["RequiredAcl", "required_acls"]


@dataclass(frozen=True)
class RequiredAcl:
    """One ALLOW binding: ``operation`` on the resource ``resource_type``/``name``
    (``pattern`` LITERAL or PREFIXED), and why the participant needs it."""

    resource_type: str
    name: str
    pattern: str
    operation: str
    why: str
    permission: str = "ALLOW"

    def describe(self, principal: str = "User:<you>") -> str:
        """As ``kafka-acls.sh --add`` spells it."""
        kind = {"TOPIC": "--topic", "GROUP": "--group", "TRANSACTIONAL_ID":
                "--transactional-id", "CLUSTER": "--cluster"}[self.resource_type]
        target = kind if self.resource_type == "CLUSTER" else f"{kind} {self.name}"
        prefixed = " --resource-pattern-type prefixed" if self.pattern == "PREFIXED" else ""
        op = self.operation.replace("_", "").title().replace("configs", "Configs")
        return f"--allow-principal {principal} --operation {op} {target}{prefixed}"


def required_acls(topic: str, sink: str | None = None, *, staged: bool = True,
                  staging_topic: str | None = None) -> list[RequiredAcl]:
    """The bindings for writing ``topic`` through sink ``sink`` (every sink when None:
    the prefix ``twophase.``), with the staging topic when the prepare is staged."""
    prefix = f"twophase.{sink}." if sink else "twophase."
    out = [
        RequiredAcl("TOPIC", topic, "LITERAL", op, why) for op, why in (
            ("WRITE", "the branches' records"),
            ("READ", "the marker is a transactional offset commit on this topic; the "
                     "redo's and the verifier's log reads"),
            ("DESCRIBE", "metadata: partitions and leaders"),
            ("DESCRIBE_CONFIGS", "max.message.bytes, checked before the first batch"),
        )
    ]
    if staged:
        staging = staging_topic or default_staging_topic(topic)
        out += [RequiredAcl("TOPIC", staging, "LITERAL", op, why) for op, why in (
            ("WRITE", "a staged prepare writes the branch here"),
            ("READ", "the commit copies the staged records to the topic"),
            ("DESCRIBE", "metadata: partitions and leaders"),
            ("DELETE", "the driver deletes the staged records of committed batches "
                       "(without it they stay until the topic's retention, and the "
                       "driver logs this grant)"),
        )]
    out += [
        RequiredAcl("TRANSACTIONAL_ID", prefix, "PREFIXED", "WRITE",
                    "each branch's (and each commit lane's) transactional.id; fencing a "
                    "lingering transaction"),
        RequiredAcl("TRANSACTIONAL_ID", prefix, "PREFIXED", "DESCRIBE",
                    "listing and describing this sink's lingering transactions"),
        RequiredAcl("GROUP", "twophase.", "PREFIXED", "READ",
                    "the marker groups (an offset commit inside the transaction), and the "
                    "groups of the staging, log and verifier readers (twophase.staged-reader, "
                    "twophase.log-reader, twophase.verify; librdkafka looks their "
                    "coordinator up)"),
        RequiredAcl("GROUP", "twophase.", "PREFIXED", "DESCRIBE",
                    "the marker groups: reading a branch's marker (committed offsets)"),
        RequiredAcl("CLUSTER", "kafka-cluster", "LITERAL", "DESCRIBE_CONFIGS",
                    "transaction.max.timeout.ms, checked against transaction_timeout_ms"),
    ]
    return out
