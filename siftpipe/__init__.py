"""siftpipe: a streaming data-pipeline stage that drops samples the live model has already learned."""

import sys as _sys

from .adapters.distributed import (
    EqualSteps,
    dist_info,
    exit_process,
    fixed_steps,
    sync_history,
    sync_memory,
)
from .adapters.predecode import PreDecodeFilter
from .audit.log import COLUMNS, AuditLog, AuditStats
from .audit.reader import LogReport, read_log, verify_log
from .audit.replay import (
    Replay,
    WhatIf,
    replay,
    whatif,
)
from .core.history import LossHistory
from .core.memory import SOURCES, ScoreMemory
from .core.policies import (
    Decision,
    HistoryPolicy,
    InfoBatch,
    Policy,
    PruneEasy,
    RelativeProbabilistic,
    TopFraction,
    Uniform,
    get_policy,
    policy_names,
    register_policy,
)
from .core.recipe import recipe
from .core.rows import shard_key
from .core.scorers import (
    CrossEntropy,
    MeanSquaredError,
    Proxy,
    ReducibleLoss,
    Scorer,
    TokenCrossEntropy,
    get_scorer,
    register_scorer,
    scorer_names,
)
from .core.sink import Decisions, DecisionSink, StageInfo
from .core.source import StatefulSource
from .core.stage import REASONS, Sifter, SiftStats
from .errors import (
    AuditError,
    BatchError,
    BatchShapeWarning,
    ConfigError,
    EmptyPassWarning,
    MissingExtraError,
    MissingKeyError,
    NonFiniteLossError,
    PassClosedError,
    PolicyError,
    PreDecodeWarning,
    RegistryError,
    RepeatedKeyWarning,
    ResumeError,
    SampleError,
    ScoreMemoryWarning,
    ScorerError,
    ScorerOutputError,
    ShardError,
    ShardWarning,
    SiftError,
    SiftInWorkerError,
)

__version__ = "0.1.0"

# Before the package was layered (docs/design.md) these modules sat at its top level: their old
# names stay the same module objects, so ``from siftpipe.policies import Policy`` keeps working.
# (``siftpipe.webdataset``, ``.nodes``, ``.shards``, ``.handlers`` and ``.logtools`` are files.)
_MOVED = {
    "distributed": "adapters.distributed",
    "history": "core.history",
    "memory": "core.memory",
    "policies": "core.policies",
    "predecode": "adapters.predecode",
    "reader": "audit.reader",
    "recipe": "core.recipe",
    "replay": "audit.replay",
    "scorers": "core.scorers",
    "sifter": "core.stage",
    "sink": "core.sink",
}
for _old, _new in _MOVED.items():
    _sys.modules.setdefault(f"{__name__}.{_old}", _sys.modules[f"{__name__}.{_new}"])
    # as before: the package's attribute is the module, unless a public name took it
    # (``siftpipe.recipe`` and ``siftpipe.replay`` are functions)
    globals().setdefault(_old, _sys.modules[f"{__name__}.{_new}"])
del _old, _new

__all__ = [
    "AuditError",
    "AuditLog",
    "AuditStats",
    "COLUMNS",
    "ConfigError",
    "CrossEntropy",
    "Decision",
    "DecisionSink",
    "Decisions",
    "EqualSteps",
    "HistoryPolicy",
    "InfoBatch",
    "LogReport",
    "LossHistory",
    "MeanSquaredError",
    "MissingExtraError",
    "BatchError",
    "MissingKeyError",
    "NonFiniteLossError",
    "Policy",
    "PolicyError",
    "PreDecodeFilter",
    "Proxy",
    "PruneEasy",
    "REASONS",
    "ReducibleLoss",
    "RegistryError",
    "RelativeProbabilistic",
    "Replay",
    "PassClosedError",
    "ResumeError",
    "SOURCES",
    "SampleError",
    "ScoreMemory",
    "Scorer",
    "ScorerError",
    "RepeatedKeyWarning",
    "BatchShapeWarning",
    "EmptyPassWarning",
    "PreDecodeWarning",
    "ScoreMemoryWarning",
    "ScorerOutputError",
    "ShardError",
    "ShardWarning",
    "SiftError",
    "SiftInWorkerError",
    "SiftStats",
    "StageInfo",
    "StatefulSource",
    "Sifter",
    "TokenCrossEntropy",
    "TopFraction",
    "Uniform",
    "WhatIf",
    "dist_info",
    "exit_process",
    "fixed_steps",
    "get_policy",
    "get_scorer",
    "policy_names",
    "read_log",
    "recipe",
    "register_policy",
    "register_scorer",
    "replay",
    "scorer_names",
    "shard_key",
    "sync_history",
    "sync_memory",
    "verify_log",
    "whatif",
]
