"""Optional dependencies: progress bars (tqdm) and plots (matplotlib) are extras, not requirements.

A missing progress-bar library means no bars; a missing plotting library is one clear error that
names the ``pip install`` to run (``MissingExtraError``)."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import MissingExtraError

#: The extra that installs each optional module.
EXTRAS = {"matplotlib": "plot", "tqdm": "progress"}


def require(module: str, what: str) -> Any:
    """Import ``module`` or raise ``MissingExtraError`` saying that ``what`` needs it and which
    ``pip install`` brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.partition(".")[0]
        raise MissingExtraError(
            f"{what} needs {top}, which is not installed: pip install 'siftpipe[{EXTRAS.get(top, top)}]'"
        ) from None


def available(module: str) -> bool:
    """Whether ``module`` imports."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


class _NoBar:
    """What a progress bar does when tqdm is not installed: nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress_bar(*, disable: bool = False, auto: bool = True, **kwargs: Any) -> Any:
    """A tqdm bar (``tqdm.auto`` when ``auto``) with ``kwargs``, or one that does nothing when
    ``disable`` is set or tqdm is not installed."""
    if disable:
        return _NoBar()
    try:
        module = importlib.import_module("tqdm.auto" if auto else "tqdm")
    except ImportError:
        return _NoBar()
    return module.tqdm(**kwargs)
