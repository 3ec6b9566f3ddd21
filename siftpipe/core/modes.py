"""Models in eval mode for a scoring forward, each module back in its own mode after it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["EvalMode", "eval_scored"]

#: ``train()`` methods that only set ``training`` on the module and its children (nn.Module's own,
#: and DistributedDataParallel's, which calls it): the switch sets those modules' flags directly
_PLAIN_TRAIN = frozenset({nn.Module.train, DistributedDataParallel.train})
_MODULE_SETATTR = nn.Module.__setattr__
_set_attribute = object.__setattr__


class EvalMode:
    """Every module of a model in eval mode for one scoring forward, then each back in the mode it
    was in: a batch-norm layer the user froze (``bn.eval()`` in a training model) stays frozen.

    ``model.eval()`` then ``model.train()`` would put every module in training mode afterwards
    (unfreezing that layer) and, through ``Module.__setattr__`` per module and per call, cost about
    1 ms a micro-batch for a ResNet-50-sized tree of 160 modules on this project's VM. The switch
    sets the flag of each module whose ``train()`` only sets it (``nn.Module``'s) directly, about
    0.5 µs a module; a module with its own ``train()`` (one that merges adapter weights on eval,
    say) gets that method called, for the switch and for the way back."""

    __slots__ = ("modules", "was")

    def __init__(self, modules: list[nn.Module], was: list[bool]) -> None:
        self.modules = modules
        self.was = was

    @classmethod
    def enter(cls, model: nn.Module) -> EvalMode | None:
        """Put every module of ``model`` in eval mode; None if none was training (nothing to undo)."""
        modules = _modules_of(model)
        was = [m.training for m in modules]
        if True not in was:
            return None
        for m in modules:
            if m.training:  # False already for the children of a module whose own train() ran
                _set_mode(m, False)
        return cls(modules, was)

    @staticmethod
    def restore_eval(model: nn.Module) -> None:
        """Every module of ``model`` back in eval mode (each was before a scorer switched it)."""
        for m in _modules_of(model):
            if m.training:
                _set_mode(m, False)

    def leave(self) -> None:
        """Put each module back in the mode it was in (parents first: a module's own ``train()``
        sets its children, and a child whose mode differs is set after it)."""
        for m, was in zip(self.modules, self.was):
            if m.training is not was:
                _set_mode(m, was)


def _modules_of(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` once each, in pre-order (a parent before its children), as
    ``model.modules()`` lists them, without its generator's names: a shared module at its first
    place, and a module registered inside its own subtree (a cycle) does not loop."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        out.append(module)
        children = module._modules
        if children:
            stack.extend([c for c in reversed(children.values()) if c is not None])
    return out


def _set_mode(module: nn.Module, training: bool) -> None:
    kind = type(module)
    if kind.train not in _PLAIN_TRAIN:
        module.train(training)
    elif kind.__setattr__ is _MODULE_SETATTR:
        # what Module.__setattr__ ends in for a plain attribute, without its checks
        _set_attribute(module, "training", training)
    else:  # a module with its own __setattr__ (a TorchScript module keeps the flag in C++)
        module.training = training


@contextmanager
def eval_scored(model: nn.Module) -> Iterator[nn.Module]:
    """``with eval_scored(model): ...``: ``model`` in eval mode inside, each module back in its
    own mode after (also when the block raises). For the models a scorer holds of its own (a
    proxy, a RHO-LOSS reference): the stage switches only its training model."""
    switch = EvalMode.enter(model)
    try:
        yield model
    finally:
        if switch is not None:
            switch.leave()
        else:  # every module was in eval mode: any the block switched (a dropout layer) go back
            EvalMode.restore_eval(model)
