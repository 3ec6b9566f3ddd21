"""``siftpipe demo``: train the same model with and without sifting, streaming WebDataset shards.

The demo writes a generated classification set to WebDataset tar shards (a local directory, or
any fsspec URL such as ``s3://...``), then trains the same MLP twice for the same number of
samples seen (``--epochs`` passes over the shards; ``--budget-seconds`` switches to a wall-time
budget): once on everything, once through a ``Sifter`` in batched mode. Both runs stream the shards
through ``siftpipe.webdataset``: DataLoader workers read the tar files, decode and batch; the
sifter runs in the training process and scores each worker batch with the live model. It prints a
table and a closing line computed from the measured numbers, writes the sifted run's audit log
and a PNG of test accuracy against wall time.

The dataset (``redundant_task``) is built to behave like real training data in the way that
matters here: most samples are near-duplicates of a few prototypes per class (learned in the first
epoch and redundant after that), and a hard tail of rare modes sits next to another class's
prototypes, so learning it takes many passes. Test accuracy is measured on fresh samples of the
same distribution (the same mix of easy and hard).

The building blocks (``redundant_task``, ``write_task_shards``, ``build_model``, ``Arm`` and
``train_run``) are public so that ``tools/`` runs the same code with more arms. The package is a
leaf: ``task`` (data and model), ``run`` (one training run), ``job`` (the command's work); only
``siftpipe.cli.demo`` imports it.
"""

from __future__ import annotations

from .job import plot_runs, run_demo, verdict
from .run import Arm, Point, RunResult, time_to_target, train_options, train_run
from .task import (
    batch_meta,
    build_model,
    decode_batch,
    redundant_task,
    task_samples,
    train_reference,
    write_task_shards,
)

__all__ = [
    "Arm",
    "Point",
    "RunResult",
    "batch_meta",
    "build_model",
    "decode_batch",
    "plot_runs",
    "redundant_task",
    "run_demo",
    "task_samples",
    "time_to_target",
    "train_options",
    "train_reference",
    "train_run",
    "verdict",
    "write_task_shards",
]
