"""Scoring: forward passes of the live model over micro-batches on its device (eval mode, no
grad, optional autocast and pinned memory, halving on out-of-memory), and the checks on what the
scorer returns."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import default_collate

from ..errors import (
    ConfigError,
    ScorerError,
    ScorerOutputError,
    SiftError,
    describe_keys,
)
from . import batch as _batch
from .modes import EvalMode
from .scorers import Scorer

__all__ = ["CPU", "ByName", "EvalMode", "Scoring", "Setting", "is_oom", "not_dense", "scoring_device"]

CPU = torch.device("cpu")

# the thread scoring each model now (by id): a second thread scoring it at once is refused, as
# the eval-mode switches of two forwards interleave and leave the model in the wrong mode
_scoring_in: dict[int, int] = {}
_scoring_lock = threading.Lock()
STRIDED = torch.strided


def not_dense(losses: torch.Tensor) -> tuple[str, str] | None:
    """What kind of tensor ``losses`` is and the fix, when it is not a dense (strided) one: a
    sparse or nested tensor has no numpy view (and a nested one not even a shape)."""
    if losses.is_nested:
        return "nested", "reduce each sample's losses to one and stack them (torch.stack)"
    if losses.layout is not STRIDED:
        return str(losses.layout).removeprefix("torch."), "loss.to_dense()"
    return None


#: Keys of a group's rows ``at``, for messages (``None``: the samples carry none).
Names = Callable[[np.ndarray], "list[Any] | None"]


def _low_precision(model: nn.Module | None) -> torch.dtype | None:
    """The 16-bit float dtype of the model's first parameter, or None."""
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        return None
    first = next(iter(parameters()), None)
    dtype = None if first is None else first.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


class Setting:
    """An attribute of the stage that one of its parts keeps: ``Sifter.model`` reads and writes
    ``Sifter._scoring.model`` (the integrations swap the model and collate_fn after construction)."""

    def __init__(self, part: str, make: Callable[[], Any]) -> None:
        self.part = part
        self.make = make  # builds the part when a setting is touched before the stage made it
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def _part(self, obj: Any) -> Any:
        part = obj.__dict__.get(self.part)
        if part is None:
            part = obj.__dict__[self.part] = self.make()
        return part

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(self._part(obj), self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(self._part(obj), self.name, value)


class ByName(Setting):
    """A ``Setting`` that takes a registered name too (``sifter.scorer = "cross_entropy"``),
    resolved when it is set (``resolve``: the object for a value), as the constructor resolves it."""

    def __init__(self, part: str, make: Callable[[], Any], resolve: Callable[[Any], Any]) -> None:
        super().__init__(part, make)
        self.resolve = resolve

    def __set__(self, obj: Any, value: Any) -> None:
        super().__set__(obj, self.resolve(value))


class Scoring:
    """The scoring part of the stage: it owns the settings below (the ``Sifter`` exposes them as
    its own attributes) and turns a group's rows into one float64 loss per row.

    ``device`` is where the current pass scores (the stage sets it when a pass starts)."""

    def __init__(
        self,
        model: nn.Module | None = None,
        scorer: Any = None,
        *,
        micro_batch: int | None = None,
        batched: bool = False,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        pad_micro_batch: bool = False,
        autocast: torch.dtype | None = None,
        pin_memory: bool = False,
        eval_mode: bool = True,
        on_oom: str = "raise",
    ) -> None:
        self.model = model
        self.scorer: Scorer = scorer  # (the stage sets it before any pass)
        self.micro_batch = micro_batch
        self.batched = batched
        self.collate_fn = collate_fn
        self.pad_micro_batch = pad_micro_batch
        self.autocast = autocast
        self.pin_memory = pin_memory
        self.eval_mode = eval_mode
        self.on_oom = on_oom
        self.device: torch.device = CPU
        # the model last checked, and what scoring calls for it (its DDP module; not sharded)
        self._checked: tuple[nn.Module | None, nn.Module | None] = (None, None)

    def rows(self, group: Any, index: np.ndarray | None, names: Names) -> np.ndarray:
        """Losses of rows ``index`` of ``group`` (all rows if None), in micro-batches.

        ``group`` has ``items`` (samples, or one batch in batched mode), ``rows`` and ``seq0``;
        ``names(at)`` gives the keys of its rows ``at`` for error messages."""
        if self.batched:
            batch = group.items[0]
            rows = group.rows
            if index is not None:
                batch = _batch.take(batch, index)
                rows = index.size
            chunk = self.micro_batch or rows
            if rows <= chunk:
                return self._score(batch, rows, group, index, names)
            at = np.arange(rows) if index is None else index
            parts = [
                self._score(
                    _batch.take(batch, np.arange(s, min(rows, s + chunk))),
                    min(chunk, rows - s),
                    group,
                    at[s : s + chunk],
                    names,
                )
                for s in range(0, rows, chunk)
            ]
            return np.concatenate(parts)
        items = group.items if index is None else [group.items[i] for i in index.tolist()]
        n = len(items)
        size = self.micro_batch
        if self.pad_micro_batch and size is not None and n < size:
            items = items + [items[-1]] * (size - n)
        try:
            batch = self.collate_fn(items)
        except Exception as exc:
            at = np.arange(n) if index is None else index
            said = names(at)
            keyless = [int(a) for a, k in zip(at.tolist(), said or [], strict=False) if k is None]
            fix = (
                f"sample seq {group.seq0 + keyless[0]} has no key while others do (None above): "
                "give every sample its key, as a micro-batch's samples must share fields"
                if keyless and isinstance(exc, KeyError)  # (what a missing field makes collating raise)
                else "give the Sifter a collate_fn that builds the batch your scorer expects"
            )
            raise ScorerError(
                f"collating micro-batch at sample seq {group.seq0 + int(at[0])} (keys "
                f"{describe_keys(said)}) failed: {type(exc).__name__}: {exc}; {fix}"
            ) from exc
        return self._score(batch, n, group, index, names, rows=len(items))

    def _score(
        self,
        batch: Any,
        n: int,
        group: Any,
        at: np.ndarray | None,
        names: Names,
        rows: int | None = None,
    ) -> np.ndarray:
        """Losses of the first ``n`` rows of ``batch``: rows ``at`` of ``group`` (for messages;
        ``None``: all of the group's rows, in order).

        ``rows`` is the batch's row count when the caller knows it (padding included)."""
        if rows is None:
            size = self.micro_batch
            if self.pad_micro_batch and size is not None and n < size:
                batch = _batch.pad_rows(batch, size)
                rows = size
            else:
                rows = n
        device = self.device
        model = self.model
        if model is not None:
            if model is not self._checked[0]:
                self._checked = (model, self._model_to_score(model))
            model = self._checked[1]
        elif self._checked[0] is not None:
            self._checked = (None, None)  # (holding the last model would keep it alive)
        # (refused before the forward, not as the scorer's error)
        held = model is not None and self.eval_mode and _hold(model)
        try:
            try:
                out = self._forward(batch, device, model)
            except Exception as exc:
                if at is None:
                    at = np.arange(group.rows)
                if self.on_oom == "split" and is_oom(exc) and rows > 1:
                    if n == 1:  # one sample and its padding: shed the padding, score the sample alone
                        return self._score(_batch.take(batch, np.arange(1)), 1, group, at[:1], names, rows=1)
                    half = n // 2
                    lo = _batch.take(batch, np.arange(half))
                    hi = _batch.take(batch, np.arange(half, rows))
                    return np.concatenate(
                        [
                            self._score(lo, half, group, at[:half], names, rows=half),
                            self._score(hi, n - half, group, at[half:], names, rows=rows - half),
                        ]
                    )
                hint = ""
                if is_oom(exc):
                    hint = "; pass on_oom='split' to retry it in halves, or lower micro_batch"
                elif isinstance(exc, TypeError) and "not numpy.ndarray" in str(exc):
                    # (found by review, 2026-12-05: torch's message names neither field nor fix)
                    hint = (
                        "; the batch holds numpy arrays where the model takes tensors: convert "
                        "them in the collate_fn (torch.as_tensor), or have the dataset give "
                        "tensors (a Hugging Face dataset: with_format('torch'))"
                    )
                low = _low_precision(model) if isinstance(exc, RuntimeError) and "dtype" in str(exc) else None
                if low is not None and self.autocast is None:
                    # found by review, 2026-12-05: Lightning's precision="bf16-true" casts the
                    # training step's inputs, never the scoring forward's
                    hint = (
                        f"; the model's weights are {low} and the batch's floats are not: pass "
                        f"Sifter(autocast={low}) to score under torch.autocast (Lightning's "
                        "precision='bf16-true' or '16-true' casts the training step's inputs, not "
                        "the scoring forward's), or cast the inputs in the scorer"
                    )
                if (
                    isinstance(exc, AttributeError)
                    and "'module'" in str(exc)
                    and self._checked[1] is not self.model  # a wrapper, scored through its module
                ):
                    # a scorer written for the wrapper (m.module(x)), before 2026-12-05
                    hint = (
                        "; the scorer is given the module DistributedDataParallel wraps (ddp.module), "
                        "not the wrapper, whose forward would broadcast buffers: call the model given"
                    )
                raise ScorerError(
                    f"scorer {self.scorer!r} raised {type(exc).__name__}: {exc} on the micro-batch of "
                    f"{n} samples at seq {group.seq0 + int(at[0])} "
                    f"(keys {describe_keys(names(at[:n]))}){hint}"
                ) from exc
            return self._check_losses(out, n, rows, device, group, 0 if at is None else int(at[0]))
        finally:
            if held:
                _let_go(model)  # type: ignore[arg-type]

    def _model_to_score(self, model: nn.Module) -> nn.Module:
        """The module a scoring forward calls for ``model``: the module a
        ``DistributedDataParallel`` wraps (its forward would broadcast buffers, a collective,
        and ranks score different numbers of micro-batches: a hang; found by review,
        2026-12-05); ``ConfigError`` for a sharded model, whose forward gathers parameters."""
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, DistributedDataParallel):
            unwrapped = inner.module  # torch.compile(DDP(m)): m, uncompiled (review, 2026-12-05)
        elif isinstance(model, DistributedDataParallel):
            unwrapped = model.module
        else:
            unwrapped = model
        for module in unwrapped.modules():  # the root, or layers sharded one by one (review)
            sharded = [c.__name__ for c in type(module).__mro__ if c.__name__ in _SHARDED]
            if sharded:
                where = "" if module is unwrapped else f", in its module {type(module).__name__}"
                raise ConfigError(
                    f"the Sifter's model ({type(model).__name__}) is sharded ({sharded[0]}{where}): "
                    "scoring it gathers its parameters with collectives, and ranks score different "
                    "numbers of micro-batches, so the job would hang. Score with no forward "
                    "(sp.recipe: losses handed back from the training step with observe()), or "
                    "use DistributedDataParallel"
                )
        return unwrapped  # type: ignore[no-any-return]

    def _forward(self, batch: Any, device: torch.device, model: nn.Module | None) -> Any:
        if device is not CPU and device.type != "cpu":
            if self.pin_memory:
                batch = _batch.pin(batch)
            batch = _batch.to_device(batch, device, non_blocking=True)
        switched = EvalMode.enter(model) if self.eval_mode and model is not None else None
        try:
            # no_grad, not inference_mode: the scoring forward is often the model's first, and what
            # it makes then (a lazy module's weights, a cached table) would be inference tensors,
            # which the training step can never train or save for backward
            with torch.no_grad():
                if self.autocast is None:
                    return self.scorer(model, batch)  # type: ignore[arg-type]
                # no cast cache: torch keys it by the weight, not the dtype, and clears it only as
                # the outermost autocast exits, so inside a training loop's own autocast of
                # another dtype the step's next forward got this one's casts ("mat1 and mat2
                # must have the same dtype"; found by review, 2026-12-06). A scoring forward
                # casts each weight once anyway
                with torch.autocast(device_type=device.type, dtype=self.autocast, cache_enabled=False):
                    return self.scorer(model, batch)  # type: ignore[arg-type]
        finally:
            if switched is not None:
                switched.leave()
            elif model is not None and self.eval_mode:
                # every module was in eval mode (nothing to undo), and the scorer may have put the
                # model, or only some of its modules (MC-dropout scoring switches its dropout
                # layers), in training mode: every module back in eval mode, as it was
                EvalMode.restore_eval(model)

    def _check_losses(
        self, out: Any, n: int, rows: int, device: torch.device, group: Any, offset: int
    ) -> np.ndarray:
        if (
            type(out) is torch.Tensor
            and out.ndim == 1
            and out.shape[0] == rows
            and out.is_floating_point()
            and out.layout is STRIDED
            and (device is CPU and not out.is_cuda and out.device.type == "cpu")
        ):
            # the common case, checked with the cheapest attribute reads: a CPU stage, a plain
            # 1-d float tensor of the right length on the CPU
            losses = out[:n] if n < rows else out
            if losses.requires_grad:
                losses = losses.detach()
            if losses.dtype != torch.float64:
                return losses.double().numpy()  # a new tensor: its memory is the stage's
            # float64 already: numpy() would share the scorer's memory, which it may reuse for
            # the next micro-batch before the losses are read (the audit log keeps them until it
            # seals a part; found by review, 2026-12-05: every row logged the last losses)
            return losses.numpy().copy()
        where = f"micro-batch at sample seq {group.seq0 + offset}"
        if not isinstance(out, torch.Tensor):
            raise ScorerOutputError(
                f"scorer {self.scorer!r} returned a {type(out).__name__} for the {where}; it must "
                f"return a torch.Tensor of shape [{rows}] (one loss per sample)"
            )
        problem = not_dense(out)
        if problem is not None:
            kind, fix = problem
            raise ScorerOutputError(
                f"scorer {self.scorer!r} returned a {kind} tensor for the {where}; it must return "
                f"a dense 1-d tensor of shape [{rows}] (one loss per sample): {fix}"
            )
        if out.ndim != 1 or out.shape[0] != rows:
            fix = (
                "use reduction='none' and reduce every dimension but the first"
                if out.ndim != 1
                else "return exactly one loss per sample of the micro-batch"
            )
            raise ScorerOutputError(
                f"scorer {self.scorer!r} returned shape {list(out.shape)} for the {where}; "
                f"expected [{rows}] (one loss per sample): {fix}"
            )
        if out.is_complex():
            # loss.float() would drop the imaginary part (only a ComplexWarning says so)
            raise ScorerOutputError(
                f"scorer {self.scorer!r} returned complex losses ({out.dtype}) for the {where}; "
                "losses must be real floating point: return the real loss you train on "
                "(loss.abs() or loss.real, chosen deliberately)"
            )
        if not out.is_floating_point():
            raise ScorerOutputError(
                f"scorer {self.scorer!r} returned dtype {out.dtype} for the {where}; losses must "
                "be floating point (return loss.float())"
            )
        od = out.device
        if od != device and (od.type != device.type or (od.index is not None and device.index is not None)):
            raise ScorerOutputError(
                f"scorer {self.scorer!r} returned losses on {out.device} for the {where}, but the "
                f"model scores on {device}; compute the loss on the model's device (a silent copy "
                "here would hide a scorer that moved work off the accelerator)"
            )
        losses = out[:n] if n < rows else out
        if losses.requires_grad:
            losses = losses.detach()
        copied = losses.dtype != torch.float64 or losses.device.type != "cpu"
        if losses.dtype != torch.float64:
            losses = losses.double()
        if device is not CPU:
            losses = losses.cpu()
        return losses.numpy() if copied else losses.numpy().copy()  # (as above)


#: Classes of models whose forward makes collectives: refused for a scoring forward
def _hold(model: nn.Module) -> bool:
    """Mark ``model`` as scored by this thread: True if this call marked it, False if this
    thread holds it already (a scorer scoring through another stage); ``SiftError`` if another
    thread scores it now (found by review, 2026-12-05: two Sifters over one model, each in its
    own thread, left it in eval mode for training, dropout off, and scored some batches in
    training mode)."""
    me = threading.get_ident()
    with _scoring_lock:
        other = _scoring_in.get(id(model))
        if other is None:
            _scoring_in[id(model)] = me
            return True
    if other == me:
        return False
    name = next((t.name for t in threading.enumerate() if t.ident == other), str(other))
    raise SiftError(
        f"the model {type(model).__name__} is being scored in thread {name!r} while thread "
        f"{threading.current_thread().name!r} scores it too: each scoring forward switches the "
        "model to eval mode and back, and two at once leave it in the wrong mode (the training "
        "step's too). Score one model from one thread: sift every stream in the training thread "
        "(one Sifter per stream is fine there), or give each thread a model of its own"
    )


def _let_go(model: nn.Module) -> None:
    with _scoring_lock:
        _scoring_in.pop(id(model), None)


_SHARDED = frozenset({"FullyShardedDataParallel", "FSDPModule", "DeepSpeedEngine"})


def scoring_device(device: Any) -> torch.device:
    """``device`` as a torch.device the stage can score on, or ``ConfigError`` naming the fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ConfigError(
            f"device={device!r} is not a torch device ({exc}); pass 'cpu', 'cuda', 'cuda:1', a "
            "torch.device, or None for the model's own device"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={device!r} but this torch sees no CUDA device; pass device='cpu' or None (the "
            "model's own device)"
        )
    return dev


def is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()
