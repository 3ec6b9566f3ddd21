"""Sift a tiny GPT-2 in the Hugging Face Trainer: generated data, CPU, nothing downloaded.

    python examples/hf_lm.py                                   # about a minute on 2 cores
    torchrun --nproc_per_node=2 examples/hf_lm.py              # 2 CPU processes (gloo)
    python examples/hf_lm.py --output runs/lm                  # checkpoints and audit log kept there
    python examples/hf_lm.py --output runs/lm --steps 300 --resume  # continue from its last checkpoint

The data: token sequences of 10 to 24 tokens that count up by 1 (90%, learned in a few dozen
steps) and, the hard tail, sequences that count up by 3, 5 or 7 (the first two tokens tell which).
The model is a 2-layer GPT-2 built from a config. Sifting is the lines marked ``# sifting``: a
``Sifter`` scoring with the model's own loss (``ModelLoss``), a score memory fed by the training
step, and ``SiftTrainer`` in place of ``Trainer``. Every decision goes to an audit log.

Rank 0 prints one JSON line: steps, samples seen and kept per process, the hard tail's share of
the data and of the kept samples (from the audit log), and the eval loss on easy and hard data.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally

from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging

import siftpipe as sp  # sifting
from siftpipe.integrations.hf import ModelLoss, SiftTrainer  # sifting

VOCAB = 32
HARD_STEPS = (3, 5, 7)


class CountingSequences(Dataset):
    """Token sequences counting up from a random start, modulo ``VOCAB``; every tenth is hard."""

    def __init__(self, n: int, seed: int, hard_only: bool = False, easy_only: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items: list[dict[str, list[int]]] = []
        self.hard: set[int] = set()
        for i in range(n):
            hard = hard_only or (not easy_only and i % 10 == 0)
            step = HARD_STEPS[int(torch.randint(len(HARD_STEPS), (1,), generator=g))] if hard else 1
            length = int(torch.randint(10, 25, (1,), generator=g))
            start = int(torch.randint(VOCAB, (1,), generator=g))
            self.items.append({"input_ids": [(start + step * t) % VOCAB for t in range(length)]})
            if hard:
                self.hard.add(i)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.items[index]


def pad(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence of the batch; padding is masked and not a target."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros(len(features), longest, dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[row, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4000, help="training sequences to generate")
    ap.add_argument("--steps", type=int, default=200, help="optimizer steps (TrainingArguments.max_steps)")
    ap.add_argument("--batch", type=int, default=16, help="kept sequences per batch and process")
    ap.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--beta", type=float, default=1.0, help="RelativeProbabilistic beta (keeps 1/(1+beta))")
    ap.add_argument("--output", default=None, help="checkpoints and audit log (default: a temporary dir)")
    ap.add_argument("--save-steps", type=int, default=50)
    ap.add_argument("--sync-every", type=int, default=0, help="steps between loss-history syncs (0: local)")
    ap.add_argument(
        "--memory-sync-every", type=int, default=50, help="steps between score-memory syncs (0: never)"
    )
    ap.add_argument(
        "--resume", nargs="?", const="last", help="continue from a checkpoint folder (default: the last one)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.resume == "last" and not args.output:
        # each run without --output writes to a new temporary directory: no last checkpoint there
        ap.error(
            "--resume continues from the last checkpoint under --output: "
            "give --output DIR (the same as the run's)"
        )
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    output = args.output or tempfile.mkdtemp(prefix="siftpipe-hf-lm-")
    started = time.perf_counter()

    torch.manual_seed(args.seed)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=VOCAB, n_positions=32, bos_token_id=0)
    config.eos_token_id = 0
    model = GPT2LMHeadModel(config)
    train = CountingSequences(args.samples, seed=args.seed)
    training_args = TrainingArguments(
        output_dir=os.path.join(output, "checkpoints"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=64,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=3e-3,
        warmup_steps=10,
        logging_steps=max(1, args.steps // 5),
        save_steps=args.save_steps,
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        disable_tqdm=True,
    )
    sifter = sp.Sifter(  # sifting
        None,  # score with the Trainer's model
        ModelLoss(),  # the model's own loss, per sequence
        sp.RelativeProbabilistic(args.beta, history=256),
        micro_batch=64,
        delay=128,
        seed=args.seed,
        memory=sp.ScoreMemory(2 * args.samples),  # fed by the training step: no second forward
        audit=os.path.join(output, "audit"),
    )
    trainer = SiftTrainer(  # sifting
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=pad,
        sifter=sifter,
        sync_every=args.sync_every or None,  # several processes: percentiles over all of them
        memory_sync_every=args.memory_sync_every or None,  # several processes: memories shared
    )
    trainer.train(resume_from_checkpoint=True if args.resume == "last" else args.resume)

    easy = trainer.evaluate(CountingSequences(256, seed=10_001, easy_only=True))["eval_loss"]
    hard = trainer.evaluate(CountingSequences(256, seed=10_002, hard_only=True))["eval_loss"]
    stats = sifter.stats
    mine = {
        "seen": stats.seen,
        "kept": stats.kept,
        "scored": stats.scored,
        "from_memory": stats.from_memory,
        "memory_received": trainer.sift_memory_received,
        # keys fed back twice in one pass: samples trained twice (none: each pass deals each once)
        "repeated": sifter.memory.repeated,
    }
    ranks = [mine]
    if dist.is_available() and dist.is_initialized():
        ranks = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(ranks, mine)
    if trainer.args.process_index != 0:
        return
    log = sp.read_log(os.path.join(output, "audit"), columns=["key", "kept"]).to_pydict()
    kept_keys = [int(k) for k, kept in zip(log["key"], log["kept"]) if kept]
    print(
        json.dumps(
            {
                "world_size": trainer.args.world_size,
                "steps": trainer.state.global_step,
                "ranks": ranks,
                "seen": sum(r["seen"] for r in ranks),
                "kept": sum(r["kept"] for r in ranks),
                "hard_share_in_data": len(train.hard) / len(train),
                "hard_share_in_kept": sum(k in train.hard for k in kept_keys) / max(1, len(kept_keys)),
                "eval_loss_easy": easy,
                "eval_loss_hard": hard,
                "seconds": round(time.perf_counter() - started, 1),
                "output": output,
            }
        )
    )


if __name__ == "__main__":
    main()
    # under torchrun the Trainer's DDP (gloo) holds its process group to the end: end without the
    # interpreter's teardown, where its threads could abort the finished job (see sp.exit_process)
    sp.exit_process(0)
