"""siftpipe: a streaming data-pipeline stage that drops samples the live model has already learned."""

from .audit import COLUMNS, AuditLog, AuditStats
from .distributed import EqualSteps, dist_info, fixed_steps, sync_history
from .errors import (
    AuditError,
    ConfigError,
    MissingExtraError,
    MissingKeyError,
    NonFiniteLossError,
    PolicyError,
    RegistryError,
    ResumeError,
    SampleError,
    ScorerError,
    ScorerOutputError,
    ShardError,
    ShardWarning,
    SiftError,
    SiftInWorkerError,
)
from .history import LossHistory
from .memory import SOURCES, ScoreMemory
from .policies import (
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
from .predecode import PreDecodeFilter
from .reader import LogReport, read_log, verify_log
from .recipe import recipe
from .replay import Replay, WhatIf, replay, whatif
from .scorers import (
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
from .sifter import REASONS, Sifter, SiftStats
from .sink import Decisions, DecisionSink, StageInfo

__version__ = "0.1.0"

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
    "ResumeError",
    "SOURCES",
    "SampleError",
    "ScoreMemory",
    "Scorer",
    "ScorerError",
    "ScorerOutputError",
    "ShardError",
    "ShardWarning",
    "SiftError",
    "SiftInWorkerError",
    "SiftStats",
    "StageInfo",
    "Sifter",
    "TokenCrossEntropy",
    "TopFraction",
    "Uniform",
    "WhatIf",
    "dist_info",
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
    "sync_history",
    "verify_log",
    "whatif",
]
