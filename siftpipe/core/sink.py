"""The interface decisions leave the stage through: plain data in, no stage internals out.

The stage (``Sifter``) knows sinks only through ``DecisionSink``; a sink knows the stage only
through the two dataclasses below. The audit log (``siftpipe.audit.AuditLog``) is one sink; a
sink of your own (metrics, a queue to another service) implements the same seven methods::

    class CountKept:
        def bind(self, info, shard_report): self.info = info
        def start(self): pass
        def write(self, decisions): self.kept = getattr(self, "kept", 0) + int(decisions.kept.sum())
        def state_dict(self): return {"kept": getattr(self, "kept", 0)}
        def check_state(self, state): pass
        def load_state_dict(self, state, resumed_from=0): self.kept = (state or {}).get("kept", 0)
        def close(self): pass

A URL given as ``Sifter(audit="s3://...")`` becomes the sink registered by ``set_url_sink``
(``siftpipe.audit`` registers ``AuditLog`` when it is imported, as ``import siftpipe`` does).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..errors import ConfigError

__all__ = ["DecisionSink", "Decisions", "StageInfo", "make_sink", "set_url_sink"]


@dataclass(frozen=True)
class StageInfo:
    """How the stage decides, handed to a sink once, before its first decisions (settings changed
    on the stage after its first pass are not in it).

    Fields: ``policy``, the policy's registered name (or class name) and ``policy_config`` its
    settings (``Policy.config()``); ``weighted``, whether it attaches weights; ``micro_batch``,
    samples per scoring forward (None: whole input batches); ``batched``, whether the input is
    collated batches; ``delay``, samples kept unscored at the start (warm-up); ``seed``, the
    ``Sifter``'s seed and ``rng_seed`` what seeded its generator (``[seed, rank]`` on a rank of a
    job); ``on_nan``, what a non-finite loss does; ``scorer``, the scorer's repr; then the fields
    documented below.
    """

    policy: str
    policy_config: dict[str, Any]
    weighted: bool
    micro_batch: int | None
    batched: bool
    delay: int
    seed: int | None
    rng_seed: Any
    on_nan: str
    scorer: str
    #: Samples per batch the stage hands on (None: as the input came), and whether a pass's
    #: short last batch is dropped (its rows then read as not kept: ``Sifter(drop_last=True)``).
    output_batch: int | None = None
    drop_last: bool = False
    #: Processes of the job (``torch.distributed``'s world size when the stage was bound; 1
    #: without one): ``verify_log`` reports a rank that left nothing in the log.
    world_size: int = 1

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values (the audit log's manifests record this as ``stage``):
        numpy scalars become numbers, anything else JSON cannot hold its ``repr``."""
        return {name: _jsonable(value) for name, value in asdict(self).items()}


@dataclass(frozen=True)
class Decisions:
    """One decided group of rows, in sequence order: rows ``seq0 .. seq0 + n - 1`` of this rank.

    ``epoch`` is the pass (``Sifter.set_epoch``) and ``model_version`` the stage's tag
    (``Sifter.model_version``, the optimizer step, say). Arrays have one entry per row: ``loss``
    (the loss the decision used, NaN when none), ``score`` (what the policy ranks by: a
    percentile in [0, 1] for the relative rule, a rank fraction for ``TopFraction``, the loss
    itself for others), ``prob`` (the keep probability drawn against, in [0, 1]), ``kept``
    (bool), ``weight`` (the weight attached to a kept row; None: all 1) and ``reason`` (an index
    into ``siftpipe.REASONS``: policy, warmup, nan, predecode, unknown; None: all policy).
    ``keys``/``urls``/``workers`` are the samples' ``__key__``,
    ``__url__`` and ``__worker__`` (``None`` when the samples carry none). ``source`` says where
    each loss came from (an index into ``siftpipe.memory.SOURCES``; one int for the whole group).
    ``micro_batch0`` is the stage's micro-batch counter at the group's first row and ``chunk`` the
    micro-batch size in rows (the micro-batch of row i is ``micro_batch0 + i // chunk``).
    """

    seq0: int
    epoch: int
    model_version: int
    keys: list[Any] | None
    urls: list[Any] | None
    workers: list[Any] | None
    loss: np.ndarray
    score: np.ndarray
    prob: np.ndarray
    kept: np.ndarray
    weight: np.ndarray | None
    reason: np.ndarray | None
    micro_batch0: int
    chunk: int
    source: np.ndarray | int
    #: Decided against loss histories merged across ranks (``sp.sync_history``), which the log
    #: does not hold: replays of these rows use each rank's own window.
    merged: bool = False

    @property
    def n(self) -> int:
        """Rows in the group."""
        return int(self.loss.shape[0])


@runtime_checkable
class DecisionSink(Protocol):
    """Where the stage's decisions go. Called on the training thread, in this order: ``bind``
    (once), ``start`` (each pass), ``write`` (each decided group), ``state_dict`` (each checkpoint;
    the sink's entry of the stage's state), ``check_state`` then ``load_state_dict`` (on resume:
    ``check_state`` raises ``ResumeError`` before anything in the stage changes), ``close``."""

    def bind(self, info: StageInfo, shard_report: Callable[[], dict[str, Any] | None]) -> None: ...

    def start(self) -> None: ...

    def write(self, decisions: Decisions) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def check_state(self, state: Mapping[str, Any] | None) -> None: ...

    def load_state_dict(self, state: Mapping[str, Any] | None, resumed_from: int = 0) -> None: ...

    def close(self) -> None: ...


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return repr(value)


_METHODS = ("bind", "start", "write", "state_dict", "check_state", "load_state_dict", "close")
_url_sink: dict[str, Callable[[Any], DecisionSink]] = {}


def set_url_sink(factory: Callable[[Any], DecisionSink]) -> None:
    """Make ``factory(url)`` the sink a URL given as ``Sifter(audit=url)`` becomes."""
    _url_sink["url"] = factory


def make_sink(value: Any) -> DecisionSink:
    """``value`` if it is a sink, else the registered URL sink made from it (a URL or path)."""
    if isinstance(value, type):
        raise ConfigError(
            f"audit= got the class {value.__name__}; pass an instance (AuditLog(url), or your sink's)"
        )
    if isinstance(value, DecisionSink):
        return value
    lacking = [name for name in _METHODS if not callable(getattr(value, name, None))]
    if len(lacking) < len(_METHODS) and not isinstance(value, str | bytes | os.PathLike):
        raise ConfigError(
            f"audit= got a {type(value).__name__} that lacks the DecisionSink methods {lacking}; "
            "a sink implements all of " + ", ".join(_METHODS) + " (see siftpipe.sink)"
        )
    factory = _url_sink.get("url")
    if factory is None:  # pragma: no cover - siftpipe's __init__ imports the audit log
        raise ConfigError("no sink is registered for URLs; import siftpipe.audit first")
    return factory(value)  # it checks the value (a URL or path) and says what is wrong
