"""siftpipe: a streaming data-pipeline stage that drops samples the live model has already learned."""

from .errors import (
    AuditError,
    ConfigError,
    MissingKeyError,
    NonFiniteLossError,
    RegistryError,
    ResumeError,
    ScorerError,
    ScorerOutputError,
    ShardError,
    SiftError,
    SiftInWorkerError,
)
from .history import LossHistory
from .policies import (
    Decision,
    Policy,
    PruneEasy,
    RelativeProbabilistic,
    TopFraction,
    Uniform,
    get_policy,
    policy_names,
    register_policy,
)
from .scorers import (
    CrossEntropy,
    MeanSquaredError,
    ReducibleLoss,
    Scorer,
    TokenCrossEntropy,
    get_scorer,
    register_scorer,
    scorer_names,
)
from .sifter import REASONS, Sifter, SiftStats

__version__ = "0.1.0"

__all__ = [
    "REASONS",
    "AuditError",
    "ConfigError",
    "CrossEntropy",
    "Decision",
    "LossHistory",
    "MeanSquaredError",
    "MissingKeyError",
    "NonFiniteLossError",
    "Policy",
    "PruneEasy",
    "ReducibleLoss",
    "RegistryError",
    "RelativeProbabilistic",
    "ResumeError",
    "Scorer",
    "ScorerError",
    "ScorerOutputError",
    "ShardError",
    "SiftError",
    "SiftInWorkerError",
    "SiftStats",
    "Sifter",
    "TokenCrossEntropy",
    "TopFraction",
    "Uniform",
    "get_policy",
    "get_scorer",
    "policy_names",
    "register_policy",
    "register_scorer",
    "scorer_names",
]
