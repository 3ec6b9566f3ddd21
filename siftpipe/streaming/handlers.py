"""Shard and sample error handlers (webdataset's convention) and the counters of what they skipped:
the one list of these names, which ``siftpipe.webdataset`` and ``siftpipe.nodes`` also offer."""

from __future__ import annotations

from .opener import (
    describe_error,
    ignore_and_continue,
    ignore_and_stop,
    reraise_exception,
    reset_shard_stats,
    shard_stats,
    warn_and_continue,
    warn_and_stop,
)

__all__ = [
    "describe_error",
    "ignore_and_continue",
    "ignore_and_stop",
    "reraise_exception",
    "reset_shard_stats",
    "shard_stats",
    "warn_and_continue",
    "warn_and_stop",
]
