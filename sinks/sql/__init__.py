"""SQL databases through SQLAlchemy's two-phase API (MySQL/MariaDB XA, PostgreSQL)."""

from twophase.sinks.sql.participant import SqlAlchemyParticipant

__all__ = ["SqlAlchemyParticipant"]
