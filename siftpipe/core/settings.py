"""The stage's settings: the constructor's checks, the scorer and policy it is given by name or
object, and the settings a checkpoint must share with the stage that resumes it."""

from __future__ import annotations

from collections.abc import Mapping
from types import NoneType
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ConfigError
from .memory import ScoreMemory
from .policies import Policy, RelativeProbabilistic, get_policy, integer_count
from .ranks import dist_info
from .scorers import Scorer, get_scorer
from .state import plain_value

__all__ = ["check_arguments", "resolve_policy", "resolve_scorer", "stage_config"]


def check_arguments(
    model: Any,
    micro_batch: Any,
    batched: bool,
    delay: Any,
    output_batch: Any,
    on_nan: Any,
    on_oom: Any,
    memory: ScoreMemory | None,
    key: Any,
    unknown: Any,
    pad_micro_batch: bool,
    seed: Any,
    autocast: Any = None,
    policy: Any = None,
    drop_last: Any = False,
    flags: Mapping[str, Any] | None = None,
) -> None:
    """Raise ``ConfigError`` naming the first ``Sifter`` argument that is out of range.

    ``flags``: yes/no settings by name (``attach_weight`` may also be None: the policy says),
    each True or False: a string such as ``"no"`` is truthy, and switched the feature on."""
    for name, value in {"drop_last": drop_last, **(flags or {})}.items():
        allowed: tuple[Any, ...] = (True, False, None) if name == "attach_weight" else (True, False)
        # (0 and 1 too: as unambiguous as False and True)
        if not (isinstance(value, bool | np.bool_ | int | NoneType) and value in allowed):
            said = "True, False or None (the policy says)" if None in allowed else "True or False"
            raise ConfigError(f"{name} must be {said}, got {value!r}")
    if drop_last and output_batch is None:
        raise ConfigError(
            "drop_last=True drops the short batch a pass ends with, so it needs output_batch= "
            "(the batch size handed on); without it batches are handed on as they are filtered"
        )
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
    if micro_batch is not None and (integer_count(micro_batch) is None or micro_batch < 1):
        raise ConfigError(
            f"micro_batch must be a number of samples >= 1, got {micro_batch!r}"
            + ("" if batched else " (None is allowed only with batched=True)")
        )
    if micro_batch is None and not batched:
        raise ConfigError("micro_batch=None (score whole input batches) needs batched=True")
    if integer_count(delay) is None or delay < 0:
        raise ConfigError(f"delay must be a number of samples >= 0, got {delay!r}")
    if output_batch is not None and (integer_count(output_batch) is None or output_batch < 1):
        raise ConfigError(f"output_batch must be a number of samples >= 1 or None, got {output_batch!r}")
    if on_nan not in ("raise", "keep", "drop"):
        raise ConfigError(f"on_nan must be 'raise', 'keep' or 'drop', got {on_nan!r}")
    if on_oom not in ("raise", "split"):
        raise ConfigError(f"on_oom must be 'raise' or 'split', got {on_oom!r}")
    if memory is not None and not isinstance(memory, ScoreMemory):
        raise ConfigError(
            f"memory must be a siftpipe.ScoreMemory or None, got {type(memory).__name__}: "
            "memory=sp.ScoreMemory(capacity=...)"
        )
    if memory is not None and key is None:
        raise ConfigError(
            "a score memory finds samples by key: give key= a field, position or callable, not None"
        )
    if unknown not in ("score", "keep"):
        raise ConfigError(f"unknown must be 'score' or 'keep', got {unknown!r}")
    if unknown == "keep" and memory is None:
        raise ConfigError(
            "unknown='keep' keeps samples the score memory does not know: pass "
            "memory=sp.ScoreMemory(capacity=...) and hand losses back with observe()"
        )
    if pad_micro_batch and micro_batch is None:
        raise ConfigError("pad_micro_batch=True needs a fixed micro_batch size to pad to")
    if not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0 (it seeds the stage's generator), got {seed!r}")
    if autocast is not None and (not isinstance(autocast, torch.dtype) or not autocast.is_floating_point):
        raise ConfigError(
            f"autocast must be a floating torch.dtype (torch.bfloat16, torch.float16) or None, got "
            f"{autocast!r}"
        )
    if policy is not None and not isinstance(policy, Policy):
        raise ConfigError(f"policy must be a siftpipe.Policy, got {policy!r}: set a policy object")


def resolve_scorer(scorer: Scorer | str) -> Scorer:
    """The scorer object for a registered name or a callable."""
    resolved = get_scorer(scorer) if isinstance(scorer, str) else scorer
    if not callable(resolved):
        raise ConfigError(f"scorer must be callable (model, batch) -> Tensor[n], got {scorer!r}")
    return resolved


def resolve_policy(policy: Policy | str | None, memory: ScoreMemory | None) -> Policy:
    """The policy object for a registered name or a ``Policy`` (default ``RelativeProbabilistic()``),
    bound to ``memory`` when it judges against the score memory."""
    if policy is None:
        policy = RelativeProbabilistic()
    resolved = get_policy(policy) if isinstance(policy, str) else policy
    if not isinstance(resolved, Policy):
        raise ConfigError(f"policy must be a siftpipe.Policy or a registered name, got {policy!r}")
    if resolved.uses_memory:
        if memory is None:
            raise ConfigError(
                f"policy {resolved!r} judges losses against the score memory: pass "
                "memory=sp.ScoreMemory(capacity=..., max_age=None) and hand losses back with observe()"
            )
        resolved.bind_memory(memory)
    return resolved


def stage_config(stage: Any) -> dict[str, Any]:
    """The settings a checkpoint must share with the stage that resumes it (see
    ``Sifter.load_state_dict``), as plain values: read from the stage's public attributes."""
    policy = stage.policy
    memory = stage.memory
    rank, world = dist_info()
    key = stage.key
    return {
        "micro_batch": stage.micro_batch,
        "batched": stage.batched,
        "output_batch": stage.output_batch,
        "delay": stage.delay,
        "policy": policy.name or type(policy).__name__,
        "policy_class": f"{type(policy).__module__}.{type(policy).__qualname__}",
        "policy_config": {k: plain_value(v) for k, v in policy.config().items()},
        "on_nan": stage.on_nan,
        "seed": stage.seed,
        # a callable cannot be compared across processes: only fields and positions are
        "key": key if key is None or isinstance(key, str | int) else "<callable>",
        "memory": None
        if memory is None
        else {
            "capacity": memory.capacity,
            "max_age": memory.max_age,
            "remember_forward": stage.remember_forward,
        },
        "unknown": stage.unknown,
        "rank": rank,
        "world": world,
    }
