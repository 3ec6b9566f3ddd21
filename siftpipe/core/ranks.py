"""This process's rank and world size, from torch.distributed or the launcher's environment."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

__all__ = ["dist_info", "rank_said"]


def dist_info(group: Any = None) -> tuple[int, int]:
    """(rank, world size): from torch.distributed if initialised, else ``$RANK``/``$WORLD_SIZE``."""

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def rank_said() -> bool:
    """Whether this process's rank is said (torch.distributed initialised, or ``$RANK`` set), so
    that ``dist_info()[0]`` will not change: 0 otherwise may be a rank not yet initialised."""
    return (dist.is_available() and dist.is_initialized()) or "RANK" in os.environ
