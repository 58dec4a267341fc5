"""`sgraf demo`: build the embedded benchmark, train SGR, SAF and a baseline, evaluate, report."""

from __future__ import annotations

import argparse

from sgraf.cli.arguments import positive_int, seed
from sgraf.config import POSITIONS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run the whole pipeline on the embedded benchmark and write a report",
        description="Generate the embedded benchmark, train SGR, SAF and a global-only baseline (and SGR and "
                    "SAF with region positions), evaluate them and the SGRAF ensembles on test, and write a "
                    "report with pictures.")
    parser.add_argument("--quick", action="store_true", help="a small, fast run for smoke tests")
    parser.add_argument("--out", default="sgraf-demo", metavar="DIR",
                        help="run folder; an earlier demo's folder is rewritten, any other "
                             "non-empty folder refused, and one that another demo is writing refused")
    parser.add_argument("--features", choices=("auto", "cnn", "synthetic"), default="auto",
                        help="benchmark features: CNN (vision extra) or synthetic; auto picks CNN when installed")
    parser.add_argument("--seed", type=seed, default=0, help="data seed, and the first training seed")
    parser.add_argument("--seeds", type=positive_int, default=1, metavar="N",
                        help="train every model with N seeds (--seed, --seed + 1, ...) on the same data and report "
                             "the mean and standard deviation of each figure")
    parser.add_argument("--positions", choices=POSITIONS, default="place",
                        help="the region positions of the SAF and SGR trained and reported beside the paper's "
                             "(place: an embedding of each region's box, plus a term comparing the places words "
                             "read, trained with half the families whole; box: the embedding only; relation: "
                             "plus self-attention over regions with a pairwise geometry bias; none: the paper's "
                             "models only)")
    parser.add_argument("--jobs", type=positive_int, default=None, metavar="N",
                        help="models trained at once, each in its own process on its share of the CPU cores "
                             "(default: one per core on a CPU, one at a time on a GPU; 1: in this process, "
                             "with progress bars)")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="extend", nargs="+",
                        help="training overrides over the demo's settings (not module, alignments, seed or positions), "
                             "e.g. --set max_violation=false")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from sgraf.demo import run_demo
    from sgraf.demo_report import at_chance, p_verdict

    record = run_demo(args.out, quick=args.quick, features=args.features, seed=args.seed,
                      progress=not args.quick, seeds=args.seeds, overrides=args.overrides or (),
                      positions=args.positions, jobs=args.jobs)
    print(record["table"])
    print()
    print(record["diagnosis_table"])
    print()
    check = record["story"]
    # the first two tests are these two claims (`demo_report.story_tests`)
    p = [f" (paired {p_verdict(test)})" for test in check.get("tests", [])] + ["", ""]
    print(f"SGRAF >= better of SGR/SAF: {'yes' if check['sgraf_ge_best_single'] else 'no'}{p[0]}; "
          f"better single > global-only: {'yes' if check['best_single_gt_global'] else 'no'}{p[1]}")
    if check.get("chance") and len(at_chance(check)) == len(check["rsum"]):
        print(f"every model is at chance level (random scores reach rsum {check['chance']['high']:.1f} by luck): "
              "a smoke test, not evidence")
    print(f"report: {args.out}/report.md ({record['timings_s']['total']:.0f} s)")
    print(f"search it in a browser: sgraf serve --index {shlex.quote(str(Path(args.out) / 'index'))}")
    return 0
