"""Scorers: ``(model, batch) -> Tensor[n]``, one loss per sample, and their registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, ScorerOutputError
from .batch import Batch, field
from .modes import eval_scored
from .registry import Registry

__all__ = [
    "CrossEntropy",
    "Proxy",
    "MeanSquaredError",
    "ReducibleLoss",
    "Scorer",
    "TokenCrossEntropy",
    "get_scorer",
    "register_scorer",
    "scorer_names",
]

#: A scorer takes the live model and a collated micro-batch already on the model's device and
#: returns a float tensor of shape ``[n]``: the loss of each sample, higher meaning "still teaches".
#: A scorer whose losses are not the training model's forward says where they come from with a
#: ``loss_source`` attribute, one of ``siftpipe.SOURCES`` (``Proxy`` has ``"proxy"``): the stage
#: counts its decisions under that source and the audit log records it (default ``"forward"``).
Scorer = Callable[[nn.Module, Batch], torch.Tensor]

_scorers: Registry[Scorer] = Registry("scorer")


def register_scorer(name: str, *, overwrite: bool = False) -> Callable[[Any], Any]:
    """Register a scorer factory under ``name``.

    The factory is called with ``get_scorer``'s keyword arguments and returns a scorer, so a class
    whose instances are scorers registers directly::

        @sp.register_scorer("focal")
        class Focal:
            def __init__(self, gamma=2.0): ...
            def __call__(self, model, batch): ...

    A plain scorer function needs no registry: pass it as ``Sifter(scorer=fn)``.

    Args:
        name: The name users pass as ``scorer=`` or to ``get_scorer``.
        overwrite: Replace an existing registration instead of raising ``RegistryError``.
    """
    return _scorers.register(name, overwrite=overwrite)


def get_scorer(name: str, **kwargs: Any) -> Scorer:
    """A new scorer: the factory registered as ``name`` called with ``kwargs``."""
    return _scorers.get(name, **kwargs)


def scorer_names() -> list[str]:
    """Registered scorer names."""
    return _scorers.names()


def _output(out: Any) -> torch.Tensor:
    """Logits or predictions from a model's output: a tensor, ``.logits``, ``["logits"]`` or ``[0]``."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(
        f"cannot find predictions in the model's output of type {type(out).__name__}; "
        "return a tensor, an object with .logits, or pass forward=... to the scorer"
    )


class _FieldScorer:
    """Shared plumbing: pick the input and target fields, run the model, reduce per sample."""

    def __init__(
        self,
        input: str | int,
        target: str | int,
        forward: Callable[[nn.Module, Any], Any] | None,
    ) -> None:
        self.input = input
        self.target = target
        self.forward = forward

    def predict(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        x = field(batch, self.input)
        y = field(batch, self.target)
        out = self.forward(model, x) if self.forward is not None else model(x)
        return _output(out), y

    def __repr__(self) -> str:
        return f"{type(self).__name__}(input={self.input!r}, target={self.target!r})"


@register_scorer("cross_entropy")
class CrossEntropy(_FieldScorer):
    """Classification cross-entropy per sample. Outputs per position (``[n, classes, d1, ...]``
    logits with ``[n, d1, ...]`` labels: segmentation) give each sample the mean of its positions'
    losses, positions labelled -100 left out (before 2026-12-05 a shape error whose fix named a
    reduction the user could not set).

    Args:
        input: Field name (dict batches) or position (tuple batches) of the model input.
        target: Field name or position of the integer class labels (or class probabilities).
        label_smoothing: As in ``torch.nn.functional.cross_entropy``.
        forward: Optional ``(model, input) -> output`` when the model is not called as ``model(x)``.
    """

    def __init__(
        self,
        input: str | int = 0,
        target: str | int = 1,
        label_smoothing: float = 0.0,
        forward: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        super().__init__(input, target, forward)
        self.label_smoothing = label_smoothing

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits, y = self.predict(model, batch)
        if (
            logits.ndim >= 3
            and not y.is_floating_point()
            and y.shape[1:] != logits.shape[2:]
            and y.shape[1:] == logits.shape[1:-1]
        ):
            # (found by review, 2026-12-05: torch's "Expected target size", naming no fix)
            raise ScorerOutputError(
                f"CrossEntropy: the model's output has shape {list(logits.shape)} and the labels "
                f"{list(y.shape)}: the classes are its last dimension, where cross-entropy takes "
                "them second ([n, classes, d1, ...], as torch). For token logits [n, T, vocab] use "
                "TokenCrossEntropy, or move the classes with forward=lambda m, x: m(x).transpose(1, -1)"
            )
        loss = F.cross_entropy(logits.float(), y, reduction="none", label_smoothing=self.label_smoothing)
        if loss.ndim > 1:  # a loss per position: their mean, per sample
            dims = tuple(range(1, loss.ndim))
            if y.is_floating_point():  # class probabilities: every position counts
                return loss.mean(dim=dims)
            return loss.sum(dim=dims) / (y != -100).sum(dim=dims).clamp(min=1)
        return loss


@register_scorer("mse")
class MeanSquaredError(_FieldScorer):
    """Mean squared error per sample (averaged over every non-batch dimension).

    Args:
        input: Field name or position of the model input.
        target: Field name or position of the regression target.
        forward: Optional ``(model, input) -> output``.
    """

    def __init__(
        self,
        input: str | int = 0,
        target: str | int = 1,
        forward: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        super().__init__(input, target, forward)

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        pred, y = self.predict(model, batch)
        err = (pred.float() - y.float().reshape(pred.shape)) ** 2
        return err.reshape(err.shape[0], -1).mean(dim=1)


@register_scorer("token_cross_entropy")
class TokenCrossEntropy(_FieldScorer):
    """Per-sequence mean token cross-entropy for language models.

    Tokens whose target is ``ignore_index`` do not count; a sequence with no counted token
    scores 0.

    Args:
        input: Field name or position of the token ids fed to the model (``[n, T]``).
        target: Field name or position of the target ids (``[n, T]``); may equal ``input``
            with ``shift=True`` for next-token prediction.
        ignore_index: Target id that is not scored (padding, prompt tokens).
        shift: Score logits at position t against target t+1 (causal LM labels not pre-shifted).
        forward: Optional ``(model, input) -> output``; outputs with ``.logits`` are understood.
    """

    def __init__(
        self,
        input: str | int = "input_ids",
        target: str | int = "labels",
        ignore_index: int = -100,
        shift: bool = False,
        forward: Callable[[nn.Module, Any], Any] | None = None,
    ) -> None:
        super().__init__(input, target, forward)
        self.ignore_index = ignore_index
        self.shift = shift

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits, y = self.predict(model, batch)
        if self.shift:
            logits, y = logits[:, :-1], y[:, 1:]
        n, t, v = logits.shape
        tok = F.cross_entropy(
            logits.reshape(n * t, v).float(),
            y.reshape(n * t),
            reduction="none",
            ignore_index=self.ignore_index,
        ).reshape(n, t)
        counted = (y != self.ignore_index).sum(dim=1)
        return tok.sum(dim=1) / counted.clamp(min=1)


@register_scorer("reducible")
class ReducibleLoss:
    """RHO-LOSS reducible loss: the training model's loss minus a reference model's loss.

    The reference ("irreducible loss") model is trained on held-out data; samples it also finds
    hard are noisy or unlearnable and score low. It is moved to the batch's device on first use
    and is in eval mode for each scoring forward (each module back in its own mode after it).

    Args:
        reference: The reference model.
        base: The per-sample loss both models are scored with: a scorer or a registered name.
        **base_kwargs: Arguments for ``get_scorer(base, ...)`` when ``base`` is a name.
    """

    def __init__(
        self, reference: nn.Module, base: Scorer | str = "cross_entropy", **base_kwargs: Any
    ) -> None:
        if not isinstance(reference, nn.Module):
            raise ConfigError(f"reference must be a torch.nn.Module, got {type(reference).__name__}")
        self.reference = reference
        self.base = get_scorer(base, **base_kwargs) if isinstance(base, str) else base

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        loss = self.base(model, batch)
        if next(self.reference.parameters(), torch.empty(0)).device != loss.device:
            self.reference.to(loss.device)
        # in eval mode for each forward, whatever mode it was left in (found by review,
        # 2026-12-05: switched once when made, a reference put back in training mode scored in
        # it, its batch-norm statistics moving with every scoring forward)
        with eval_scored(self.reference) as reference:
            return loss - self.base(reference, batch)

    def __repr__(self) -> str:
        return f"ReducibleLoss(reference={type(self.reference).__name__}, base={self.base!r})"


@register_scorer("proxy")
class Proxy:
    """Score a cheaper stand-in for the sample: a downscaled input and/or a smaller model.

    Composer's selective backprop scores a downscaled image (``scale_factor``); a small proxy
    model (``model``) is the other common shortcut. The audit log records these decisions with
    source ``proxy``. A downscaled input needs a model that accepts it (global pooling, say).

    Args:
        base: The per-sample loss: a scorer or a registered name.
        scale_factor: Resize the input field by this factor (e.g. 0.5) with
            ``torch.nn.functional.interpolate``; inputs are ``[n, C, H, W]`` (or ``[n, C, L]``).
        input: Field name or position of the input to resize.
        model: Score with this model instead of the training model (moved to the batch's device
            on first use; in eval mode for each scoring forward, each module back in its own mode
            after it, so a proxy trained online may be left in training mode).
        mode: Interpolation mode.
        **base_kwargs: Arguments for ``get_scorer(base, ...)`` when ``base`` is a name.
    """

    loss_source = "proxy"

    def __init__(
        self,
        base: Scorer | str = "cross_entropy",
        *,
        scale_factor: float | None = None,
        input: str | int = 0,
        model: nn.Module | None = None,
        mode: str = "bilinear",
        **base_kwargs: Any,
    ) -> None:
        if scale_factor is not None and not (0 < scale_factor <= 1):
            raise ConfigError(f"scale_factor must be in (0, 1] (a downscale), got {scale_factor!r}")
        if scale_factor is None and model is None:
            raise ConfigError("a proxy needs scale_factor=, model=, or both")
        if isinstance(base, str):
            base_kwargs.setdefault("input", input)
            self.base: Scorer = get_scorer(base, **base_kwargs)
        else:
            self.base = base
        self.scale_factor = scale_factor
        self.input = input
        self.model = model
        self.mode = mode

    def __call__(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        if self.scale_factor is not None and self.scale_factor != 1:
            x = field(batch, self.input)
            small = F.interpolate(
                x.float(), scale_factor=self.scale_factor, mode=self.mode if x.ndim == 4 else "linear"
            ).to(x.dtype)
            if isinstance(batch, dict):
                batch = {**batch, self.input: small}
            else:
                batch = list(batch)
                batch[self.input] = small  # type: ignore[index]
        if self.model is not None:
            device = next((t.device for t in _tensors(batch)), None)
            if device is not None and next(self.model.parameters(), torch.empty(0)).device != device:
                self.model.to(device)
            # (as ReducibleLoss's reference: a proxy trained online is left in training mode)
            with eval_scored(self.model) as proxy:
                return self.base(proxy, batch)
        return self.base(model, batch)

    def __repr__(self) -> str:
        what = [f"scale_factor={self.scale_factor}"] if self.scale_factor else []
        if self.model is not None:
            what.append(f"model={type(self.model).__name__}")
        return f"Proxy({self.base!r}, {', '.join(what)})"


def _tensors(batch: Batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, list | tuple) else []
    return [v for v in values if isinstance(v, torch.Tensor)]
