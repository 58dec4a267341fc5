"""`curves.png`: training loss and validation rsum of a run against the optimisation step; and
several runs' curves in one picture (`plot_runs`: the demo's `curves.png`, `sgraf runs --plot`)."""

from __future__ import annotations

import os
import pathlib
from typing import Mapping, Sequence

from sgraf.atomic_write import atomic_path
from sgraf.errors import InputError
from sgraf.training.run_dir import CURVES_FILE, read_metrics


def _drawable(records: list[dict]) -> list[dict]:
    """The records with a numeric step and rsum (one edited by hand without them had stopped the
    drawing with a KeyError)."""
    def number(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    return [record for record in records if number(record.get("step")) and number(record.get("rsum"))]


def plot_curves(run: str | os.PathLike[str], path: str | os.PathLike[str] | None = None) -> pathlib.Path | None:
    """Draws the curves of `run`'s metrics.jsonl into a PNG (default `RUN/curves.png`).

    Returns:
        The PNG path, or None when the run has no validation yet.
    """
    if not pathlib.Path(run).is_dir():
        raise InputError(f"{run}: no such run folder")
    records = _drawable(read_metrics(run))
    if not records:
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    out = pathlib.Path(path) if path is not None else pathlib.Path(run) / CURVES_FILE
    steps = [r["step"] for r in records]
    losses = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    fig, (ax_loss, ax_rsum) = plt.subplots(1, 2, figsize=(10, 3.8))
    if losses:
        ax_loss.plot(*zip(*losses), marker="o", color="tab:red")
    ax_loss.set(xlabel="step", ylabel="training loss (mean since last validation)", title="loss")
    ax_rsum.plot(steps, [r["rsum"] for r in records], marker="o", color="tab:blue")
    best = max(records, key=lambda r: r["rsum"])
    ax_rsum.axhline(best["rsum"], color="gray", linestyle=":", linewidth=1)
    ax_rsum.set(xlabel="step", ylabel="rsum (dev)", title=f"validation rsum (best {best['rsum']:.1f})")
    for ax in (ax_loss, ax_rsum):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))    # steps are whole numbers
    return _save(plt, fig, out, dpi=100)


def plot_runs(runs: Mapping[str, str | os.PathLike[str]], path: str | os.PathLike[str]) -> pathlib.Path:
    """Draws the training loss and dev rsum of several runs (`runs`: {label: run folder}, each
    from its metrics.jsonl; a run without validations draws nothing) into one PNG, one colour
    per run, labelled in a legend.

    Returns:
        The PNG path.

    Raises:
        InputError: no runs, a folder that is not there, or a `path` that is one of a run's
            files (`check_plot_output`).
    """
    if not runs:
        raise InputError("plot_runs: no runs to draw")
    for folder in runs.values():
        if not pathlib.Path(folder).is_dir():
            raise InputError(f"{folder}: no such run folder")
    check_plot_output(list(runs.values()), path, label="path")
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    out = pathlib.Path(path)
    drawn = {label: records for label, records in ((label, _drawable(read_metrics(run)))
                                                   for label, run in runs.items())
             if records}
    columns = min(4, max(1, len(drawn)))
    legend_rows = -(-len(drawn) // columns)
    height = 3.6 + 0.18 * legend_rows          # the legend below both panels, never over a curve
    figure, (loss_axis, rsum_axis) = plt.subplots(1, 2, figsize=(10, height))
    for (label, records), style in zip(drawn.items(), _styles(len(drawn))):
        # a folder name of bytes that are not UTF-8 reaches Python as lone surrogates, which the
        # font cannot draw: drawn with a replacement character where they stand
        label = label.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        steps = [r["step"] for r in records]
        losses = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
        if losses:
            loss_axis.plot(*zip(*losses), label=label, **style)
        rsum_axis.plot(steps, [r["rsum"] for r in records], label=label, **style)
    loss_axis.set(xlabel="step", ylabel="training loss (mean per validation period)", title="loss")
    rsum_axis.set(xlabel="step", ylabel="rsum on dev", title="validation rsum")
    for axis in (loss_axis, rsum_axis):
        axis.grid(alpha=0.3)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, labels = rsum_axis.get_legend_handles_labels()
    bottom = (0.18 * legend_rows + 0.12) / height if handles else 0.0
    if handles:
        figure.legend(handles, labels, loc="lower center", ncol=columns, fontsize=8, frameon=False)
    return _save(plt, figure, out, dpi=90, rect=(0, bottom, 1, 1))


def _styles(count: int) -> list[dict[str, object]]:
    """A colour (and, past 20 runs, a line style and a marker) per run, none repeated: matplotlib's
    ten colours up to 10 runs, its twenty up to 20, then twenty colours by four styles."""
    import matplotlib

    palette = matplotlib.colormaps["tab10" if count <= 10 else "tab20"].colors
    lines, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D")
    return [{"color": palette[k % len(palette)], "linestyle": lines[k // len(palette) % 4],
             "marker": markers[k // len(palette) % 4]} for k in range(count)]


def check_plot_output(folders: Sequence[str | os.PathLike[str]], path: str | os.PathLike[str],
                      label: str = "--plot") -> None:
    """Refuses a picture path that is one of the runs' own files (`curves.png`, `metrics.jsonl`, ...:
    inputs here), in `sgraf.io_paths.check_outputs`'s one line, or a run file of another run folder."""
    from sgraf.io_paths import check_outputs, resolved
    from sgraf.training.run_dir import RUN_FILES
    from sgraf.training.runs import run_folder_of

    check_outputs([("run file", f"{folder}/{name}") for folder in folders for name in RUN_FILES], [(label, path)])
    target = resolved(path)
    if run_folder_of(target) is not None:     # a run not listed here
        raise InputError(f"{label} {path} is the {target.name} of the run folder {target.parent}; an output must "
                         "not write over a run's files: choose another path")


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend (`sgraf.plotting.pyplot`)."""
    from sgraf.plotting import pyplot

    return pyplot()


def _save(plt, figure, out: pathlib.Path, dpi: int,
          rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> pathlib.Path:
    """Writes `figure` (its axes laid out within `rect`) to `out` as a PNG whole or not at all, and closes it."""
    figure.tight_layout(rect=rect)
    try:
        with atomic_path(out) as temporary:
            figure.savefig(temporary, format="png", dpi=dpi)
    finally:
        plt.close(figure)
    return out
