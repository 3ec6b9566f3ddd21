"""The decision vocabulary every layer shares: reason and loss-source codes, the fields a
PreDecodeFilter adds to samples (core, audit and adapters alike)."""

from __future__ import annotations

__all__ = ["PRE_KEPT", "PRE_LOSS", "PRE_PROB", "REASONS", "SOURCES", "loggable_text"]

#: ``reason`` codes of a decision, in the order of their small-integer codes.
REASONS: tuple[str, ...] = ("policy", "warmup", "nan", "predecode", "unknown")
#: Where a decision's loss came from (the ``source`` column), in the order of their codes.
SOURCES: tuple[str, ...] = ("forward", "feedback", "stale", "proxy", "none")

#: Field marking a sample kept by a ``PreDecodeFilter`` (1), or unknown to it (0).
PRE_KEPT = "__sift_prekept__"
#: The remembered loss a ``PreDecodeFilter`` decided a kept sample by.
PRE_LOSS = "__sift_preloss__"
#: The keep probability a ``PreDecodeFilter`` gave a kept sample.
PRE_PROB = "__sift_preprob__"


def loggable_text(text: str) -> str:
    """``text`` as an audit log records it: itself, or, when it holds a lone surrogate (a tar
    member or file name that was not valid UTF-8, as Python's tarfile and os decode it), its bytes
    with the invalid ones written ``\\xNN`` (``caf\\xe9``): every log format needs valid UTF-8,
    and a key that cannot be recorded lost the records written with it."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        try:
            return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:
            # a surrogate no undecodable byte gives (U+D800-U+DC7F: a JSON "\ud800"): written
            # \ud800; it raised, and the part holding it was lost (found by review, 2026-12-06)
            return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text
