"""The demo's results in words and pictures: the tables, the paper's story, `report.md`.

`sgraf.demo` runs the pipeline and hands its record (`results.json`) here: `format_table` lays
the test results out like the paper's Table 1, `format_diagnosis` what each model tells apart
per kind of hard negative, `story` says whether the run tells the paper's story, and
`write_report` writes `report.md` around them; `draw_curves` and `draw_diagnosis` draw
`curves.png` and `diagnose.png`. With several training seeds every figure is a `mean_sd`
summary (cells `mean±sd`). The retrieval pictures are `sgraf.demo_retrieval`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sgraf.atomic_write import atomic_path, write_text

# The models' order in the tables and pictures.
LABELS = ("global-only", "SAF", "SGR", "SGRAF", "SAF+pos", "SGR+pos", "SGRAF+pos")


def mean_sd(values: list[Any]) -> Any:
    """The mean and sample standard deviation of numbers at the same place in nested dicts.

    `[{"rsum": 1.0, "i2t": {"r1": 2.0}}, ...]` -> `{"rsum": {"mean", "sd"}, "i2t": {"r1": {...}}}`;
    `sd` is None for one value; a place that is None in every dict stays None.
    """
    first = values[0]
    if isinstance(first, dict):
        return {key: mean_sd([value[key] for value in values]) for key in first}
    if first is None or isinstance(first, (str, bool)):
        return first
    numbers = np.asarray(values, dtype=np.float64)
    return {"mean": float(numbers.mean()), "sd": float(numbers.std(ddof=1)) if len(numbers) > 1 else None}


def _cell(value: Any, width: int) -> str:
    """A number, or `mean±sd` from `mean_sd`, right-aligned in `width` characters."""
    if value is None:
        return f"{'-':>{width}}"
    if isinstance(value, dict):
        if value["sd"] is None:
            return f"{value['mean']:>{width}.1f}"
        return f"{value['mean']:.1f}\u00b1{value['sd']:.1f}".rjust(width)
    return f"{value:>{width}.1f}"


def _name(label: str) -> str:
    return label if label == "global-only" else f"Ours({label})"


def _order(results: dict[str, Any]) -> tuple[list[str], int]:
    """The labels of `results` in table order, and the width of the tables' first column (as
    before positions existed unless a longer name needs more)."""
    order = [label for label in LABELS if label in results]
    return order, max(14, *(len(_name(label)) + 1 for label in order))


def format_table(results: dict[str, dict[str, Any]], title: str) -> str:
    """The test results in the layout of the paper's Table 1 (R@K in %, plus rsum).

    `results` holds `evaluate_sims` results, or their `mean_sd` summaries (cells `mean±sd`).
    """
    order, first = _order(results)
    spread = any(isinstance(results[m]["rsum"], dict) and results[m]["rsum"]["sd"] is not None for m in order)
    width = 10 if spread else 7
    rsum_width = width + 1 if spread else width
    side = 3 * width - 1
    rows = []
    for label in order:
        result = results[label]
        i2t, t2i = result["i2t"], result["t2i"]
        rows.append(f"{_name(label):<{first}}|"
                    f"{_cell(i2t['r1'], width)}{_cell(i2t['r5'], width)}{_cell(i2t['r10'], width)} |"
                    f"{_cell(t2i['r1'], width)}{_cell(t2i['r5'], width)}{_cell(t2i['r10'], width)} |"
                    f"{_cell(result['rsum'], rsum_width)}")
    return "\n".join([title,
                      f"{'':<{first}}| {'Sentence Retrieval':^{side}} | {'Image Retrieval':^{side}} |",
                      f"{'Methods':<{first}}| {'R@1':>{width - 1}}{'R@5':>{width}}{'R@10':>{width}} | "
                      f"{'R@1':>{width - 1}}{'R@5':>{width}}{'R@10':>{width}} |{'rsum':>{rsum_width}}",
                      "-" * max(len(row) for row in rows), *rows])


def format_diagnosis(diagnosis: dict[str, dict[str, Any]], title: str) -> str:
    """Winoground group score per kind of hard negative, and truth-aware R@1, per model (in %).

    `diagnosis` holds `diagnose_sims` results, or their `mean_sd` summaries.
    """
    from sgraf.data.benchmark import VARIANTS

    def percent(value: Any) -> Any:   # fractions -> percent, keeping the mean_sd shape
        if isinstance(value, dict):
            return {"mean": 100 * value["mean"], "sd": None if value["sd"] is None else 100 * value["sd"]}
        return None if value is None else 100 * value

    order, first = _order(diagnosis)
    spread = any(isinstance(diagnosis[m]["all"]["group"], dict) and diagnosis[m]["all"]["group"]["sd"] is not None
                 for m in order)
    width = 11 if spread else 10
    kinds = (*VARIANTS, "all")
    rows = []
    for label in order:
        row = diagnosis[label]
        truth = row["recall"]["truth"]
        rows.append(f"{_name(label):<{first}}|" + "".join(_cell(percent(row[kind]["group"]), width) for kind in kinds)
                    + " |" + _cell(truth["i2t"]["r1"], width) + _cell(truth["t2i"]["r1"], width))
    return "\n".join([title,
                      f"{'':<{first}}|{'Winoground group score (chance 16.7)':^{width * len(kinds)}} |"
                      f"{'truth-aware R@1':^{2 * width}}",
                      f"{'Methods':<{first}}|" + "".join(f"{kind:>{width}}" for kind in kinds) + " |"
                      + f"{'i2t':>{width}}{'t2i':>{width}}",
                      "-" * max(len(row) for row in rows), *rows])


def story(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whether the run tells the paper's story, in rsum: SGRAF >= max(SGR, SAF) > global-only.

    `results` holds `evaluate_sims` results or `mean_sd` summaries (then the means are compared).
    """
    rsum = {label: results[label]["rsum"] for label in results}
    rsum = {label: value["mean"] if isinstance(value, dict) else value for label, value in rsum.items()}
    best_single = max(rsum["SGR"], rsum["SAF"])
    return {"sgraf_ge_best_single": rsum["SGRAF"] >= best_single,
            "best_single_gt_global": best_single > rsum["global-only"],
            "rsum": rsum}


def story_tests(sims: dict[str, np.ndarray], results: dict[str, dict[str, Any]],
                resamples: int = 10000) -> list[dict[str, Any]]:
    """The story's comparisons, paired on the test images (`sgraf.significance.compare`, as `sgraf
    compare` makes them) on one seed's score matrices and their `evaluate_sims` results: SGRAF
    against the better single model, that model against global-only, and SGRAF+pos against SGRAF
    when present. Each: ``{"a", "b", "difference", "interval", "p"}`` of rsum."""
    from sgraf.significance import compare

    best = max(("SGR", "SAF"), key=lambda label: results[label]["rsum"])
    pairs = [("SGRAF", best), (best, "global-only")] + ([("SGRAF+pos", "SGRAF")] if "SGRAF+pos" in sims else [])
    tests = []
    for a, b in pairs:
        result = compare(sims[a], sims[b], resamples=resamples)
        tests.append({"a": a, "b": b, "difference": result["difference"]["rsum"],
                      "interval": result["interval"]["rsum"], "p": result["p"]["rsum"], "resamples": resamples})
    return tests


def at_chance(check: dict[str, Any]) -> list[str]:
    """The models of a `story` check (with its ``"chance"``: `sgraf.significance.chance_rsum`) whose
    rsum is not above what random scores reach by luck (its ``high`` quantile)."""
    chance = check.get("chance")
    if not chance:
        return []
    return [label for label, value in check["rsum"].items() if value <= chance["high"]]


def chance_text(check: dict[str, Any]) -> str:
    """A line for the report on the chance level, and what it means for the story when some or
    all models are not above it ('' without one)."""
    chance = check.get("chance")
    if not chance:
        return ""
    low = at_chance(check)
    text = (f"Random scores give rsum {chance['mean']:.1f} on this split, and {chance['high']:.1f} or more "
            f"in {100 * (1 - chance['level']):.0f} % of random draws (`sgraf.significance.chance_rsum`). ")
    if len(low) == len(check["rsum"]):
        return text + ("Every model here is within that: they have not learnt enough to be told from chance, "
                       "so the comparisons below say nothing about the paper's claims (a smoke test; the "
                       "demo without `--quick` trains them).")
    if low:
        return text + f"Not above it: {', '.join(low)}; comparisons with {'it' if len(low) == 1 else 'them'} " \
                      "say little."
    return text + "Every model is above it."


def p_verdict(test: dict[str, Any]) -> str:
    """One `story_tests` test's p-value as the report and the closing line say it, as `sgraf
    compare` prints it (`significance.p_text`): ``p 0.031``, ``p <=1.0e-04`` at its floor, or
    ``p 0.091, within noise`` at p >= 0.05."""
    from sgraf.significance import p_text

    return f"p {p_text(test['p'], test.get('resamples', 10000))}" + ("" if test["p"] < 0.05 else ", within noise")


# --------------------------------------------------------------------------------- pictures
def draw_curves(path: Path, runs: dict[str, Path]) -> str:
    """Each model's training loss and dev rsum over the steps, from the `metrics.jsonl` of its run
    folder (`runs`: {label: folder}; `sgraf.training.plots.plot_runs`); returns the picture's
    file name."""
    from sgraf.training.plots import plot_runs

    plot_runs(runs, path)
    return path.name


def draw_diagnosis(summary: dict[str, dict[str, Any]], n_seeds: int, path: Path) -> str:
    """Bars of the Winoground group score per kind of hard negative and model (mean over seeds,
    with the standard deviation as error bars), the chance level dashed."""
    from sgraf.plotting import pyplot

    plt = pyplot()

    from sgraf.data.benchmark import VARIANTS

    kinds = (*VARIANTS, "all")
    labels = [label for label in LABELS if label in summary]
    figure, axis = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(labels)
    for number, label in enumerate(labels):
        cells = [summary[label][kind]["group"] for kind in kinds]
        means = [100 * cell["mean"] if cell else 0.0 for cell in cells]
        errors = [100 * cell["sd"] if cell and cell["sd"] is not None else 0.0 for cell in cells]
        positions = np.arange(len(kinds)) + (number - (len(labels) - 1) / 2) * width
        axis.bar(positions, means, width, yerr=errors if n_seeds > 1 else None, capsize=3, label=label)
    axis.axhline(100 / 6, color="grey", linestyle="--", linewidth=1, label="chance (16.7)")
    axis.set_xticks(np.arange(len(kinds)), kinds)
    axis.set(ylabel="Winoground group score (%)",
             title="What each model tells apart, per kind of hard negative (test split"
                   + (f"; mean \u00b1 sd over {n_seeds} seeds)" if n_seeds > 1 else ")"))
    axis.grid(axis="y", alpha=0.3)
    axis.legend(fontsize=8, ncol=5, loc="upper left")
    axis.set_ylim(0, 105)
    figure.tight_layout()
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=90)
    plt.close(figure)
    return path.name


# --------------------------------------------------------------------------------- report
def _parallel_text(plan: dict[str, int]) -> str:
    if plan["workers"] <= 1:
        return "The models trained one after the other (`training` is the sum of their times)."
    threads = f"{plan['threads']} thread" + ("" if plan["threads"] == 1 else "s")
    return (f"The models trained {plan['workers']} at a time, {threads} each (`sgraf.training.pool`; `--jobs` "
            "sets how many): each `train` time is that model's own, `training` the whole stage's, and the CPU "
            "times include the training processes'.")


def write_report(out: Path, record: dict[str, Any], recipe: str = "") -> Path:
    """`report.md`: what was run, the table, whether it tells the paper's story, the pictures.

    `record` is the demo's `results.json`; `recipe` says in words how the position-aware models
    were trained beyond the demo's settings (`sgraf.demo.recipe_text`; '' when as the paper's)."""
    check = record["story"]
    rsum = check["rsum"]
    # the ensemble of the index and pictures (`sgraf.demo.served_ensemble`)
    served, members = record["served"]["ensemble"], " + ".join(record["served"]["models"])
    timings = ", ".join(f"{k} {v:.0f} s" for k, v in record["timings_s"].items())
    cpu = ", ".join(f"{k} {v:.0f} s" for k, v in record["cpu_s"].items())
    verdict = []
    verdict.append(f"- SGRAF (rsum {rsum['SGRAF']:.1f}) "
                   f"{'>=' if check['sgraf_ge_best_single'] else '<'} the better of SGR ({rsum['SGR']:.1f}) "
                   f"and SAF ({rsum['SAF']:.1f}).")
    verdict.append(f"- The better single model {'>' if check['best_single_gt_global'] else '<='} "
                   f"global-only ({rsum['global-only']:.1f}).")
    if "SGRAF+pos" in rsum:
        kinds = record["summary"]["diagnose"]
        relation = {label: kinds[label]["relation"]["group"] for label in ("SGRAF", "SGRAF+pos")}
        relation = {label: 100 * (value["mean"] if isinstance(value, dict) else value)
                    for label, value in relation.items() if value is not None}
        verdict.append(f"- With positions: SGRAF+pos rsum {rsum['SGRAF+pos']:.1f} (SGRAF {rsum['SGRAF']:.1f})"
                       + (f", relation group score {relation['SGRAF+pos']:.1f} (SGRAF {relation['SGRAF']:.1f}, "
                          "chance 16.7)." if len(relation) == 2 else "."))
    tests = check.get("tests")
    if tests:
        seed_words = f"the first seed's ({record['seeds'][0]}) " if len(record["seeds"]) > 1 else ""
        verdict.append(f"- Paired on the {record['settings']['n_test']} test images ({seed_words}score matrices, "
                       "as `sgraf compare` does; 95 % bootstrap interval of the rsum difference, randomization "
                       "p-value):")
        verdict += [f"  - {t['a']} - {t['b']}: {t['difference']:+.1f} [{t['interval'][0]:+.1f}, "
                    f"{t['interval'][1]:+.1f}], {p_verdict(t)}"
                    for t in tests]
    settings = record["settings"]
    training = record["training"]["SGR"]["config"]
    seeds = record["seeds"]
    if len(seeds) > 1:
        seeds_text = (f"Every model was trained with {len(seeds)} seeds ({', '.join(map(str, seeds))}) on the "
                      "same data; each figure is the mean \u00b1 the sample standard deviation over the seeds "
                      "(every seed's figures are in `results.json`; the pictures come from the first seed's "
                      "models).")
    else:
        seeds_text = "One training seed: differences of a point or two are within seed noise."
    diagnosis = [
        "## What each model tells apart",
        "",
        "Every test family holds a base picture and its binding, attribute, relation and count twins. "
        "For each twin, its captions false for the base and the base's captions false for it are "
        "paired (`sgraf diagnose`): the **group** score counts a pair correct when each picture "
        "scores its own caption higher and each caption scores its own picture higher (chance "
        "16.7 %). Truth-aware R@1 counts a retrieved picture of the caption's family as correct "
        "unless the caption is false for it.",
        "",
        "```",
        record["diagnosis_table"],
        "```",
        "",
        "![group scores per kind](diagnose.png)",
        "",
    ]
    lines = [
        "# sgraf demo report",
        "",
        f"{'Quick (smoke-test) run' if record['quick'] else 'Full run'} on the embedded benchmark "
        f"(`{record['benchmark']['features']}` features, {settings['n_train']} / {settings['n_dev']} / "
        f"{settings['n_test']} train / dev / test images, 5 captions each, data seed {record['seed']}).",
        "",
        f"Each model trained independently with the `demo` preset plus `{' '.join(settings['train_overrides'])}` "
        f"(embed {training['embed_size']}, sim {training['sim_dim']}, {training['epochs']} "
        f"epoch{'s' if training['epochs'] != 1 else ''}, "
        f"batch {training['batch_size']}); the checkpoint with the best dev rsum is evaluated. "
        "global-only is Table 3 row 1 (FC + sigmoid on the global alignment); SGRAF averages the "
        "SGR and SAF score matrices."
        + (f" SAF+pos and SGR+pos are the same two models with region positions "
           f"(`positions={settings['positions']}`, not in the paper"
           + (f"; trained {recipe}" if recipe else "")
           + "); SGRAF+pos averages them."
           if settings.get("positions", "none") != "none" else ""),
        "",
        "```",
        record["table"],
        "```",
        "",
        seeds_text,
        "",
        *([chance_text(check), ""] if check.get("chance") else []),
        "The paper's story (rsum" + (", means" if len(seeds) > 1 else "") + "):",
        *verdict,
        "",
        *diagnosis,
        f"Wall-clock timings: {timings}. CPU time (all threads): {cpu}; on a machine shared with other work "
        "the wall clock overstates the cost.",
        "",
        _parallel_text(record.get("training_workers", {"workers": 1}))
        + (f" Continued from an earlier demo's runs in this folder (stopped or finished, with the same settings "
           f"and data): {', '.join(record['resumed'])}; their `train` times are this run's part only, so the "
           "timings above do not measure the demo." if record.get("resumed") else ""),
        "",
        "## Training curves",
        "",
        "![curves](curves.png)",
        "",
        "## Retrieval examples",
        "",
        f"Through the gallery index of the test split (`index/`, the one `sgraf serve` searches), every picture "
        f"or caption re-ranked by the {served} ensemble ({members}; no shortlist: the ranking the table's recall "
        "measures). A result is a hit when "
        "the caption is true of the picture: its own picture, or a twin of its family it is not false for "
        "(green: solid for its own, dashed for a twin); red, dotted: a miss. The rows are the test queries at "
        "the 12.5, 37.5, 62.5 and 87.5 % quantiles of the rank of their first hit in the table's score "
        "matrix, so hits and misses appear about as often as the truth-aware recall counts them.",
        "",
        "![text to image](retrieval_t2i.png)",
        "",
        "![image to text](retrieval_i2t.png)",
        "",
        "## What the models attend to",
        "",
        f"Test image 0 with one of its captions, then with a caption of its hard negative (the next image "
        f"of its family, one change away), scored by {served}. Top: SAF's weight on each alignment, SGR's "
        "cosine between the reasoned read-out and each raw alignment; below: each token's attention over the "
        "image.",
        "",
        "![positive](explain_positive.png)",
        "",
        "![negative](explain_negative.png)",
        "",
    ]
    path = out / "report.md"
    write_text(path, "\n".join(lines))
    return path
