"""Run under torchrun (two gloo processes) by tests/integrations/test_lightning.py: a sifted
Lightning DDP fit with the default recipe (a score memory fed by the training steps), checkpointed
every 10 steps (each rank's epoch is 10 batches: the checkpoints fall at epochs' last steps), or
resumed from one of them. Each rank writes what it trained and its final weights to
``<out>/rank-<r>.json``; rank 0 prints one JSON line.

Usage: lightning_ddp_resume.py OUT [CKPT]
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import lightning.pytorch as L
import torch

import siftpipe as sp
from siftpipe.integrations.lightning import SiftCallback
from tests.integrations.lightning_ddp_loaders import ddp_trainer
from tests.integrations.test_lightning import Net, Points

warnings.filterwarnings("ignore")


def main(out: str, ckpt: str | None) -> None:
    torch.manual_seed(0)
    sift = SiftCallback(
        lambda: sp.recipe(None, sp.CrossEntropy("x", "y"), budget=480, min_spread=None, micro_batch=32)
    )
    model = Net(sift, Points(240), dropout=0.0)
    checkpoints = L.callbacks.ModelCheckpoint(
        dirpath=out, save_top_k=-1, filename="{step}", every_n_train_steps=10, enable_version_counter=False
    )
    trainer = ddp_trainer(
        max_steps=36,
        default_root_dir=out,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[sift, checkpoints],
    )
    trainer.fit(model, ckpt_path=ckpt)
    weights = [p.detach().double().flatten().tolist() for p in model.parameters()]
    with open(os.path.join(out, f"rank-{trainer.global_rank}.json"), "w") as f:
        json.dump({"trained": model.trained, "weights": weights, "kept": sift.sifter.stats.kept}, f)
    if trainer.global_rank == 0:
        print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
    sp.exit_process(0)  # (Lightning leaves the gloo process group up: no teardown to abort in)
