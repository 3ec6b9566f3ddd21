"""What an audit log says in brief: totals, keep rate over time, loss quantiles, the most-dropped
shards; and its plot."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._secrets import redact
from ..errors import ConfigError

__all__ = ["SUMMARY_COLUMNS", "plot_log", "print_summary", "summarize"]

#: The columns ``summarize`` reads (read only these from a large log).
SUMMARY_COLUMNS = ["seq", "kept", "loss", "reason", "url", "epoch"]


def summarize(table: Any, *, buckets: int = 10, top_shards: int = 10) -> dict[str, Any]:
    """Totals, keep rate over sequence, loss quantiles kept vs dropped, and the most-dropped shards."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = table.num_rows
    if n == 0:
        return {"records": 0}
    kept = table.column("kept").to_numpy(zero_copy_only=False)
    loss = table.column("loss").to_numpy()
    seq = table.column("seq").to_numpy()
    reason_counts = {
        str(row["values"]): int(row["counts"]) for row in pc.value_counts(table.column("reason")).to_pylist()
    }
    out: dict[str, Any] = {
        "records": n,
        "kept": int(kept.sum()),
        "dropped": int(n - kept.sum()),
        "keep_rate": float(kept.mean()),
        "reasons": reason_counts,
    }
    if "run" in table.column_names:
        out["runs"] = sorted({str(r) for r in pc.unique(table.column("run")).to_pylist()})
        out["ranks"] = sorted(int(r) for r in pc.unique(table.column("rank")).to_pylist())
    if "epoch" in table.column_names:
        out["epochs"] = sorted(int(e) for e in pc.unique(table.column("epoch")).to_pylist())
    # keep rate over time: equal slices of the sequence (across ranks, by rank-local seq); the
    # records of samples dropped before decode (seq -1, read_log(include_predecode=True)) have
    # no place in it and are counted apart
    staged = seq >= 0
    out["predecode_dropped"] = int(n - staged.sum())
    out["keep_rate_over_seq"] = []
    if staged.any():
        seq_s, kept_s = seq[staged], kept[staged]
        lo, hi = int(seq_s.min()), int(seq_s.max()) + 1
        span = hi - lo
        # no more slices than seqs: a stream of 4 records had six empty, backwards ones
        # ("seq 4..3"; found by review, 2026-12-06)
        buckets = min(buckets, span)
        which = (seq_s - lo) * buckets // span
        counts = np.bincount(which, minlength=buckets)
        kept_counts = np.bincount(which[kept_s], minlength=buckets)
        # bucket i holds the seqs v with i <= (v - lo) * buckets / span < i + 1: its first is
        # lo + ceil(i * span / buckets) (labels from linspace named other rows than it counted)
        starts = lo + (np.arange(buckets + 1) * span + buckets - 1) // buckets
        out["keep_rate_over_seq"] = [
            {
                "seq_from": int(starts[i]),
                "seq_to": int(starts[i + 1]) - 1,
                "records": int(counts[i]),
                "keep_rate": float(kept_counts[i] / counts[i]) if counts[i] else None,
            }
            for i in range(buckets)
        ]
    finite = np.isfinite(loss)
    q = [0.1, 0.5, 0.9]

    def quantiles(mask: np.ndarray) -> dict[str, float | None]:
        values = loss[mask & finite]
        if not values.size:
            return {"p10": None, "p50": None, "p90": None, "mean": None}
        # one partition around the three ranks, as np.quantile's "lower" method picks them
        ranks = [int(np.floor(p * (values.size - 1))) for p in q]
        values.partition(ranks)
        p = values[ranks]
        with np.errstate(over="ignore"):
            mean = float(values.mean())
        if not np.isfinite(mean):
            # the sum overflowed (finite losses near the float maximum): their mean does not
            mean = float(np.mean(values / values.size)) * values.size
        return {"p10": float(p[0]), "p50": float(p[1]), "p90": float(p[2]), "mean": mean}

    out["loss_kept"] = quantiles(kept)
    out["loss_dropped"] = quantiles(~kept)
    if "url" in table.column_names:
        url = table.column("url")
        if not isinstance(url.type, pa.DictionaryType):
            url = pc.dictionary_encode(url)
        # count on the dictionary codes: no string is touched per row
        url = pa.table({"url": url}).unify_dictionaries().column("url").combine_chunks()
        # samples without a shard URL (in-memory sources, plain lists) have null codes
        codes = url.indices.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
        valid = (codes >= 0) & ~np.asarray(url.is_null().to_numpy(zero_copy_only=False))
        codes = np.where(valid, codes, 0)
        urls = url.dictionary.to_pylist()
        seen = np.bincount(codes[valid], minlength=len(urls))
        kept_by = np.bincount(codes[valid & kept], minlength=len(urls))
        dropped = seen - kept_by
        order = [i for i in np.argsort(-dropped, kind="stable") if seen[i]][:top_shards]
        out["most_dropped_shards"] = [
            {
                # as recorded, and without credentials also in a log written before they were
                # kept out of the url column
                "url": None if urls[i] is None else redact(urls[i]),
                "records": int(seen[i]),
                "dropped": int(dropped[i]),
                "keep_rate": float(kept_by[i] / seen[i]),
            }
            for i in order
        ]
    return out


def _spans(numbers: list[int]) -> str:
    """Sorted integers as runs: ``[0, 1, 2, 3, 7]`` -> ``"0..3, 7"`` (a 250-epoch log printed
    every epoch number on one line)."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in spans) or "none"


def print_summary(s: Mapping[str, Any], out: Any) -> None:
    if not s.get("records"):
        print("no records", file=out)
        return
    print(
        f"records {s['records']}  kept {s['kept']}  dropped {s['dropped']}  keep rate {s['keep_rate']:.4f}",
        file=out,
    )
    if "runs" in s:
        epochs = _spans(s["epochs"]) if isinstance(s.get("epochs"), list) else s.get("epochs")
        print(f"runs {', '.join(s['runs'])}  ranks {s['ranks']}  epochs {epochs}", file=out)
    print("reasons: " + ", ".join(f"{k} {v}" for k, v in sorted(s["reasons"].items())), file=out)
    if s.get("predecode_dropped"):
        print(f"dropped before decode (PreDecodeFilter): {s['predecode_dropped']}", file=out)
    print("\nkeep rate over sequence:", file=out)
    for b in s["keep_rate_over_seq"]:
        rate = "   -  " if b["keep_rate"] is None else f"{b['keep_rate']:.4f}"
        bar = "" if b["keep_rate"] is None else "#" * round(b["keep_rate"] * 40)
        print(f"  seq {b['seq_from']:>12}..{b['seq_to']:<12} {rate}  {bar}", file=out)
    print("\nloss           p10        p50        p90       mean", file=out)
    for name in ("kept", "dropped"):
        qs = s[f"loss_{name}"]
        cells = "".join(
            "         -" if qs[k] is None else f" {qs[k]:>10.4g}" for k in ("p10", "p50", "p90", "mean")
        )
        print(f"  {name:<8}{cells}", file=out)
    if s.get("most_dropped_shards") == []:
        print("\nmost-dropped shards: none recorded (the samples carried no __url__)", file=out)
    elif s.get("most_dropped_shards"):
        print("\nmost-dropped shards:", file=out)
        for row in s["most_dropped_shards"]:
            print(
                f"  {row['dropped']:>9} dropped of {row['records']:>9} "
                f"(keep {row['keep_rate']:.3f})  {row['url']}",
                file=out,
            )


def plot_log(table: Any, path: str) -> str:
    """Write a figure: keep rate over sequence, loss histograms kept vs dropped, prob vs score.

    ``path``: the file; its suffix picks the format (``.png``, ``.svg``, ``.pdf``, ...); none
    means ``.png``, and a folder (an existing one, or a path ending in ``/``) gets ``sift.png``
    in it. Returns the path written; an unknown suffix raises ``ConfigError`` (nothing written)."""
    from .._optional import require

    require("matplotlib", "siftpipe log plot").use("Agg")
    import matplotlib.pyplot as plt

    path = _plot_path(path, plt)

    kept = table.column("kept").to_numpy(zero_copy_only=False)
    loss = table.column("loss").to_numpy()
    seq = table.column("seq").to_numpy()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    order = np.argsort(seq, kind="stable")
    window = max(1, min(5000, seq.size // 50))
    rolling = np.convolve(kept[order].astype(float), np.ones(window) / window, mode="valid")
    axes[0].plot(seq[order][window - 1 :], rolling, lw=1)
    axes[0].set(
        title=f"keep rate (rolling {window} samples)",
        xlabel="sequence number",
        ylabel="keep rate",
        ylim=(0, 1.02),
    )
    finite = np.isfinite(loss)
    if finite.any():
        lo, hi = float(loss[finite].min()), float(np.quantile(loss[finite], 0.995))
        if not hi > lo:  # one loss, or all equal: a bin around it (not a division by zero)
            lo, hi = lo - 0.5, hi + 0.5
        bins = np.linspace(lo, hi, 60)
        shown = finite & (loss >= lo) & (loss <= hi)  # (the top 0.5% beyond the bins)
        for rows, label in ((shown & kept, "kept"), (shown & ~kept, "dropped")):
            if rows.any():  # a density of no samples in the bins divides by zero
                axes[1].hist(loss[rows], bins=bins, alpha=0.6, label=label, density=True)
        axes[1].legend()
    axes[1].set(title="loss: kept vs dropped", xlabel="loss", ylabel="density")
    score = table.column("score").to_numpy()
    prob = table.column("prob").to_numpy()
    pick = np.flatnonzero(np.isfinite(score) & np.isfinite(prob))
    if pick.size > 20000:
        pick = np.random.default_rng(0).choice(pick, 20000, replace=False)
    axes[2].scatter(score[pick], prob[pick], s=2, alpha=0.3)
    axes[2].set(
        title="keep probability vs policy score",
        xlabel="score (the policy's: docs/audit.md)",
        ylabel="keep probability",
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the plot to {path!r}: {exc.strerror or exc}; give a path in a folder "
            "that exists and can be written (siftpipe log plot -o)"
        ) from None
    finally:
        plt.close(fig)
    return path


def _plot_path(path: str, plt: Any) -> str:
    """Where ``plot_log`` writes for ``path`` (see there)."""
    if not path:
        # (it wrote ./.png.png and said "wrote .png": review, 2026-12-06)
        raise ConfigError("the plot needs a file name: siftpipe log plot -o NAME.png (or a folder)")
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return os.path.join(path, "sift.png")
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if not suffix:
        return path + ".png"
    from matplotlib.backend_bases import FigureCanvasBase

    # (a classmethod: no figure made, none of the caller's closed)
    known = FigureCanvasBase.get_supported_filetypes()
    if suffix not in known:
        raise ConfigError(
            f"cannot write the plot as {path!r}: matplotlib writes no .{suffix} files; end the path "
            f"with one of {', '.join('.' + k for k in sorted(known))} (siftpipe log plot -o)"
        )
    return path
