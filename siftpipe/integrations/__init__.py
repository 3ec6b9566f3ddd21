"""Sifting inside the trainers people already use.

* ``siftpipe.integrations.hf``: ``SiftTrainer`` (or ``SiftTrainerMixin`` for your own ``Trainer``
  subclass) for the Hugging Face ``Trainer``, and ``ModelLoss``, the per-sample loss a
  ``transformers`` model's own training loss is made of. Needs ``pip install "siftpipe[hf]"``.
* ``siftpipe.integrations.lightning``: ``SiftCallback`` for PyTorch Lightning. Needs
  ``pip install "siftpipe[lightning]"``.

Each submodule imports its trainer only when it is imported itself; a missing one raises
``MissingExtraError`` (an ``ImportError`` and a ``SiftError``) naming the ``pip install`` to run.
"""

from __future__ import annotations

import siftpipe as sp

__all__ = ["MissingExtraError"]


class MissingExtraError(sp.SiftError, ImportError):
    """An integration's trainer package is not installed; the message names the extra to install."""

    @classmethod
    def of(cls, module: str, extra: str, packages: str, cause: ImportError) -> MissingExtraError:
        """The error for ``module``, which needs ``packages`` from ``siftpipe[extra]``."""
        missing = cause.name or str(cause)
        return cls(
            f'{module} needs {packages} ({missing} is not importable): pip install "siftpipe[{extra}]"'
        )
