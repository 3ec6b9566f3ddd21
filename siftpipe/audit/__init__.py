"""The audit log: a decision sink (``log``), its Parquet wire format and writer process (``wire``),
reading back (``reader``), replay and what-if (``replay``), summaries (``summary``). Importing it
registers ``AuditLog`` as the sink for URLs, as ``import siftpipe`` does."""

from .log import COLUMNS, AuditLog, AuditStats

__all__ = ["COLUMNS", "AuditLog", "AuditStats"]
