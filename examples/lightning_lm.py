"""Sift a tiny causal language model in PyTorch Lightning: generated data, CPU, nothing downloaded.

    python examples/lightning_lm.py                        # about a minute on 2 cores
    python examples/lightning_lm.py --devices 2            # DDP on 2 CPU processes (gloo)
    python examples/lightning_lm.py --output runs/lm       # checkpoints kept there
    python examples/lightning_lm.py --output runs/lm --resume last  # continue from its last checkpoint

The data: token sequences of 10 to 24 tokens that count up by 1 (90%, learned fast) and, the hard
tail, sequences that count up by 3, 5 or 7 (the first two tokens tell which). The model is a
2-layer causal transformer. Sifting is the lines marked ``# sifting``: a ``SiftCallback`` with a
``Sifter`` that scores each sequence's mean token loss, the DataLoader wrapped by
``sift.loader``, and ``sift.loss`` in ``training_step`` (per-sample losses in, the loss to
optimise out; they also feed the score memory, so trained sequences are not scored again).

Rank 0 prints one JSON line: epochs and steps, samples seen and kept per rank, the hard tail's
share of the data and of what was trained, and the final eval loss on easy and hard sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

import lightning.pytorch as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import siftpipe as sp  # sifting
from siftpipe.integrations.lightning import SiftCallback  # sifting

VOCAB = 32
HARD_STEPS = (3, 5, 7)


class CountingSequences(Dataset):
    """Token sequences counting up from a random start, modulo ``VOCAB``; every tenth is hard."""

    def __init__(self, n: int, seed: int, hard_only: bool = False, easy_only: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items: list[list[int]] = []
        self.hard: set[int] = set()
        for i in range(n):
            hard = hard_only or (not easy_only and i % 10 == 0)
            step = HARD_STEPS[int(torch.randint(len(HARD_STEPS), (1,), generator=g))] if hard else 1
            length = int(torch.randint(10, 25, (1,), generator=g))
            start = int(torch.randint(VOCAB, (1,), generator=g))
            self.items.append([(start + step * t) % VOCAB for t in range(length)])
            if hard:
                self.hard.add(i)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return {"tokens": self.items[index]}


def pad(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch with -100, which the loss ignores."""
    longest = max(len(s["tokens"]) for s in samples)
    tokens = torch.full((len(samples), longest), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        tokens[row, : len(s["tokens"])] = torch.tensor(s["tokens"])
    return {"tokens": tokens}


class TinyCausalLM(nn.Module):
    def __init__(self, width: int = 64, layers: int = 2, length: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(length, width)
        layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.1, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens.clamp(min=0)) + self.position(torch.arange(t, device=tokens.device))
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        return self.head(self.blocks(x, mask=causal, is_causal=True))


def sequence_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence (padding ignored): one loss per sample."""
    targets = tokens[:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, ignore_index=-100, reduction="none")
    return per_token.sum(1) / (targets != -100).sum(1).clamp(min=1)


def score(model: nn.Module, batch: dict) -> torch.Tensor:
    """The Sifter's scorer: the same per-sequence loss as the training step."""
    return sequence_loss(model(batch["tokens"]), batch["tokens"])


class LanguageModel(L.LightningModule):
    def __init__(self, sift: SiftCallback, train: CountingSequences, batch: int, lr: float) -> None:
        super().__init__()
        self.net = TinyCausalLM()
        self.sift = sift
        self.train_data = train
        self.batch = batch
        self.lr = lr
        self.trained = self.trained_hard = 0  # measured for the summary, not needed to sift

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def train_dataloader(self) -> object:
        loader = DataLoader(self.train_data, batch_size=self.batch, shuffle=True, collate_fn=pad)
        return self.sift.loader(loader)  # sifting

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        self.trained += len(batch["__key__"])  # the dataset's index of each kept sequence
        self.trained_hard += sum(int(k) in self.train_data.hard for k in batch["__key__"])
        per_sample = sequence_loss(self(batch["tokens"]), batch["tokens"])
        return self.sift.loss(per_sample, batch)  # sifting: weights, feedback, mean

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4000, help="training sequences to generate")
    ap.add_argument("--epochs", type=int, default=6, help="passes over the data")
    ap.add_argument("--steps", type=int, default=-1, help="stop after this many optimizer steps")
    ap.add_argument("--batch", type=int, default=32, help="kept sequences per batch and process")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--beta", type=float, default=1.0, help="RelativeProbabilistic beta (keeps 1/(1+beta))")
    ap.add_argument("--devices", type=int, default=1, help="CPU processes (2 or more: DDP over gloo)")
    ap.add_argument("--output", default=None, help="checkpoints (default: a temporary directory)")
    ap.add_argument("--save-every", type=int, default=50, help="checkpoint every this many steps")
    ap.add_argument("--resume", default=None, help="a checkpoint path, or 'last'")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.resume == "last" and not args.output:
        # each run without --output writes to a new temporary directory: no last checkpoint there
        ap.error(
            "--resume continues from the last checkpoint under --output: "
            "give --output DIR (the same as the run's)"
        )
    warnings.filterwarnings("ignore", module="lightning")
    torch.set_num_threads(1)
    output = args.output or tempfile.mkdtemp(prefix="siftpipe-lightning-lm-")
    started = time.perf_counter()

    L.seed_everything(args.seed, verbose=False)
    train = CountingSequences(args.samples, seed=args.seed)
    sift = SiftCallback(  # sifting: a function, so each DDP rank builds its own, seeded with its rank
        lambda: sp.Sifter(
            None,  # score with the LightningModule
            score,
            sp.RelativeProbabilistic(args.beta, history=256),
            micro_batch=128,
            delay=256,
            seed=args.seed,
            memory=sp.ScoreMemory(2 * args.samples),  # fed by sift.loss: no second forward
        )
    )
    model = LanguageModel(sift, train, args.batch, lr=3e-3)
    checkpoints = L.callbacks.ModelCheckpoint(
        dirpath=os.path.join(output, "checkpoints"),
        every_n_train_steps=args.save_every,
        save_top_k=-1,
        save_last=True,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=[sift, checkpoints],  # sifting
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    resume = os.path.join(output, "checkpoints", "last.ckpt") if args.resume == "last" else args.resume
    trainer.fit(model, ckpt_path=resume)

    stats = sift.sifter.stats
    mine = {
        "seen": stats.seen,
        "kept": stats.kept,
        "trained": model.trained,
        "trained_hard": model.trained_hard,
        "discarded": sift.stream.discarded,
    }
    ranks = [mine]
    if dist.is_available() and dist.is_initialized():
        ranks = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(ranks, mine)
        dist.destroy_process_group()  # Lightning leaves it up: its threads end before the interpreter
    model.eval()
    with torch.inference_mode():
        losses = {}
        for name, data in (
            ("easy", CountingSequences(256, seed=10_001, easy_only=True)),
            ("hard", CountingSequences(256, seed=10_002, hard_only=True)),
        ):
            batch = pad([data[i] for i in range(len(data))])
            losses[name] = float(score(model, batch).mean())
    if trainer.global_rank != 0:
        return
    print(
        json.dumps(
            {
                "world_size": trainer.world_size,
                "epochs": trainer.current_epoch,
                "steps": trainer.global_step,
                "ranks": ranks,
                "seen": sum(r["seen"] for r in ranks),
                "kept": sum(r["kept"] for r in ranks),
                "hard_share_in_data": len(train.hard) / len(train),
                "hard_share_in_trained": sum(r["trained_hard"] for r in ranks)
                / max(1, sum(r["trained"] for r in ranks)),
                "eval_loss_easy": losses["easy"],
                "eval_loss_hard": losses["hard"],
                "seconds": round(time.perf_counter() - started, 1),
                "output": output,
            }
        )
    )


if __name__ == "__main__":
    main()
