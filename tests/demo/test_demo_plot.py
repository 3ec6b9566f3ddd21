"""The demo's plot shows every evaluation: the y-axis used to start at the 20% quantile of the
accuracies minus 2 points (about 91% in the demo), and the early points fell off the plot."""

from __future__ import annotations

import math

import matplotlib.figure

from siftpipe.demo import Point, RunResult, plot_runs

CURVE = [0.31, 0.52, 0.78, 0.93, 0.975, 0.985, 0.989, 0.991, 0.992, 0.9923]


def run(name: str, shift: float) -> RunResult:
    points = [
        Point(seen=100 * i, forward=100 * i, backward=100 * i, seconds=1.0 + i, accuracy=a + shift)
        for i, a in enumerate(CURVE)
    ]
    return RunResult(
        name=name,
        points=points,
        seen=1000,
        scored=0,
        trained=1000,
        from_memory=0,
        predecode_dropped=0,
        seconds=10.0,
        accuracy=points[-1].accuracy,
        train_seconds=1.0,
        score_seconds=0.0,
        epochs=1.0,
        cpu_seconds=math.nan,
    )


def test_the_plot_shows_every_evaluation_and_a_zoom_on_the_top(tmp_path, monkeypatch):
    figures = []
    save = matplotlib.figure.Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    results = [run("full", 0.0), run("sifted", 0.0004)]
    path = tmp_path / "plot.png"
    plot_runs(results, str(path), title="demo")
    assert path.stat().st_size > 0 and len(figures) == 1
    every = [100 * p.accuracy for r in results for p in r.points]
    low, high = figures[0].axes[0].get_ylim()
    assert low <= min(every) and high >= max(every), "an evaluation fell off the plot"
    zoom_low, zoom_high = figures[0].axes[1].get_ylim()
    assert zoom_low > low and zoom_high >= max(every), "the second panel zooms on the top"
