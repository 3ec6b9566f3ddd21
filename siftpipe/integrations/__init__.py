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

# one class: ``except sp.MissingExtraError`` catches an integration's too (until 2026-12-06 this
# module defined a second one, which it did not: found by review)
from ..errors import MissingExtraError

__all__ = ["MissingExtraError"]
