"""Per-sample losses on their way from a CUDA device to the host, without waiting for them.

``Sifter.observe`` gets the training step's losses right after the step was queued on the GPU. A
blocking ``.cpu()`` there makes the host wait for the step to finish before it can queue the next
one: every step, the GPU then idles while the host prepares the next. A ``HostCopy`` queues the
copy behind the step (into page-locked memory, ``non_blocking``) and records an event; the score
memory waits for the event only when it applies the losses (before its next read: the stage's next
decision, once per input batch), by which time the copy has usually long finished.
"""

from __future__ import annotations

import time

import numpy as np
import torch

__all__ = ["HostCopy", "host_losses"]


class HostCopy:
    """float32 losses being copied from a CUDA tensor to the host.

    ``size``: how many; ``result()``: the 1-d array, once the copy has finished (it waits for the
    copy, and for the kernels queued before it on the tensor's stream); ``waited``: seconds it
    waited there (the training step's time, not the stage's)."""

    __slots__ = ("_event", "_host", "size", "waited")

    def __init__(self, losses: torch.Tensor) -> None:
        values = _flat_float32(losses)
        self.size = int(values.numel())
        self.waited = 0.0
        if values.is_cuda:
            # a CUDA tensor copied non_blocking to the CPU lands in page-locked memory: the copy
            # runs on the device's current stream after what was queued there (the step)
            stream = torch.cuda.current_stream(values.device)
            # values may be the caller's own tensor, made on another stream and freed when the
            # call returns: its memory must not be handed out again before this copy has read it
            values.record_stream(stream)
            self._host = values.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            self._event: torch.cuda.Event | None = event
        else:  # (a copy: the caller may reuse its buffer after observe() returns)
            self._host = values.to("cpu", copy=True)
            self._event = None

    def result(self) -> np.ndarray:
        """The losses, as a 1-d float32 array (waits for the copy to finish)."""
        event = self._event
        if event is not None:
            t0 = time.perf_counter()
            event.synchronize()
            self.waited += time.perf_counter() - t0
            self._event = None
        return self._host.numpy()


def host_losses(losses: torch.Tensor) -> np.ndarray | HostCopy:
    """``losses`` (any shape) as float32 on the host: a started ``HostCopy`` for a CUDA tensor,
    else a 1-d array now (other accelerators' tensors copied synchronously; a float32 CPU
    tensor's own data, not a copy: ``ScoreMemory.defer_keys`` copies what it keeps)."""
    if losses.is_cuda:
        return HostCopy(losses)
    return _flat_float32(losses).cpu().numpy()


def _flat_float32(losses: torch.Tensor) -> torch.Tensor:
    """``losses`` detached, 1-d, float32 (what the memory keeps: numpy has no bfloat16)."""
    values = losses.detach()
    if values.dtype is not torch.float32:
        values = values.float()
    return values.reshape(-1)
