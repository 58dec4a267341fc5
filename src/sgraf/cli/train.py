"""`sgraf train`: train SGR, SAF or a joint model from a preset, a YAML file and overrides.

    sgraf train --data DIR --out RUN_DIR [--preset NAME] [--config YAML] [--set key=value ...]
    sgraf train --resume RUN_DIR [--set epochs=N ...] [--data DIR --allow-other-data]
    torchrun --nproc_per_node N -m sgraf train ...      (several processes)

Exit status: 0 when the run finished, 2 for bad input (a run folder locked by another run
included), 1 when the loss became NaN/inf, 128 + the signal number (143 for SIGTERM, 130 for
SIGINT) when a signal stopped the run after saving `last.pt`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
from typing import Any

logger = logging.getLogger("sgraf.cli.train")


def register(subparsers: Any) -> None:
    from sgraf.training.config import PRESETS

    parser = subparsers.add_parser(
        "train", help="train a model (paper recipes, resumable, several processes with torchrun)",
        description="Train SGRAF on a precomp data folder. The config is resolved from the defaults, "
                    "then --preset, then --config, then --set. The run folder gets config.yaml, "
                    "metrics.jsonl, last.pt, best.pt and curves.png; while the run owns it, it is locked "
                    "(RUN_DIR/.sgraf-lock): a second run there is refused, naming the first.",
        epilog="presets: " + ", ".join(PRESETS) + ". Valid --set keys: see --list-keys. Region positions (not in "
               "the paper; the data needs boxes): --set positions=place batches=families family_share=0.5 "
               "place_sharpness=2 place_penalty=true, for SGR also global_loss_weight=1 (docs/positions.md).")
    parser.add_argument("--data", metavar="DIR", help="precomp folder with train_* and dev_* files")
    parser.add_argument("--out", metavar="RUN_DIR", help="run folder to create")
    parser.add_argument("--preset", metavar="NAME", help=f"named recipe: {', '.join(PRESETS)}")
    parser.add_argument("--config", metavar="YAML", help="YAML file of config keys (may also name 'data')")
    parser.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="extend", nargs="+",
                        help="override config keys, e.g. --set module=saf epochs=10 precision=bf16")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last.pt")
    parser.add_argument("--allow-other-data", action="store_true",
                        help="with --resume: continue on a --data folder other than the run's (another folder, "
                             "or its files changed since), which is refused otherwise: dev rsum would be "
                             "compared across different dev splits")
    parser.add_argument("--allow-unknown-words", action="store_true",
                        help="train even when the vocabulary leaves over half of the training tokens unknown "
                             "(refused otherwise; a warning above 10%%)")
    parser.add_argument("--list-keys", action="store_true", help="print the config keys of a preset and exit")
    parser.add_argument("--json", action="store_true",
                        help="print the run's summary as one JSON object on stdout (status, signal, epoch, epochs, "
                             "global_step, best_rsum, best_step, best_epoch, stopped_early, last_loss, run_dir)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sgraf.errors import InputError
    from sgraf.training.config import RESUMABLE_KEYS, fixed_keys_changed, parse_overrides, resolve_config
    from sgraf.training.loop import fit
    from sgraf.training.step import NonFiniteLossError
    from sgraf.training.run_dir import load_run_config

    args.overrides = args.overrides or []   # no --set (None, so that --help shows no default)

    if args.list_keys:
        config, _ = resolve_config(args.preset, args.config, args.overrides)
        for key, value in config.to_dict().items():
            print(f"{key}: {value}")
        return 0
    if args.resume:
        if args.preset or args.config or args.out:
            raise InputError("--resume continues a run as it was configured; it takes no --preset, --config "
                             "or --out (only --data and --set " + ", ".join(RESUMABLE_KEYS) + ")")
        from pathlib import Path

        config_path = Path(args.resume) / "config.yaml"
        if not Path(args.resume).is_dir():
            raise InputError(f"cannot resume {args.resume}: no such folder")
        if not config_path.is_file():
            from sgraf.training.runs import only_a_lock

            lone = only_a_lock(Path(args.resume))
            if lone is not None and lone[0]:
                raise InputError(f"cannot resume: {lone[1]}")
            raise InputError(f"cannot resume {args.resume}: it has no config.yaml " + (
                "(a run stopped before it began: start it again with --out)" if lone is not None
                else "(not a sgraf run folder)"))
        config, data, preset = load_run_config(Path(args.resume))
        overrides = parse_overrides(args.overrides)
        # a key set to the value the run has is no change (a script may repeat its whole --set line)
        fixed = sorted(fixed_keys_changed(config, overrides))
        if fixed:
            raise InputError(f"--set {', '.join(fixed)} cannot change when resuming; keys that can: "
                             f"{', '.join(RESUMABLE_KEYS)}")
        out, resume = args.resume, True
        data = args.data or data
        config = config.replace(**overrides)   # fit records it in config.yaml once the data is checked
    else:
        if args.allow_other_data:
            raise InputError("--allow-other-data applies to --resume RUN_DIR (a new run trains on its --data)")
        config, extras = resolve_config(args.preset, args.config, args.overrides)
        for flag, given, key in (("--data", args.data, "data"), ("--preset", args.preset, "preset")):
            same = (lambda a, b: os.path.realpath(a) == os.path.realpath(b)) if key == "data" else str.__eq__
            if given and extras.get(key) and not same(str(extras[key]), given):
                logger.warning("%s %s is used; %s's %s: %s is not", flag, given, args.config, key, extras[key])
        data = args.data or extras.get("data")
        if not data or not args.out:
            raise InputError("sgraf train needs --data DIR and --out RUN_DIR (or --resume RUN_DIR)")
        out, resume, preset = args.out, False, args.preset or extras.get("preset")
    from sgraf import distributed
    from sgraf.cli.arguments import data_inputs
    from sgraf.io_paths import check_outputs
    from sgraf.training.run_dir import RUN_FILES

    out_label = "--resume" if resume else "--out"
    check_outputs([*data_inputs(data, ["train", "dev"]), ("--config", args.config)],
                  [(out_label, out), *((out_label, f"{out}/{name}") for name in RUN_FILES)])
    if not resume:    # after: "--out is the input --data" says more
        from sgraf.cli.arguments import refuse_others_folder

        refuse_others_folder("--out", out, writes="a training run")
    clean = False
    try:
        summary = fit(config, data, out, resume=resume, preset=preset, allow_other_data=args.allow_other_data,
                      allow_unknown_words=args.allow_unknown_words)
        clean = True
    except NonFiniteLossError as error:
        print(f"sgraf train: error: {error}", file=sys.stderr)
        return 1
    finally:
        main_process, world = distributed.is_main_process(), distributed.get_world_size()
        distributed.cleanup(barrier=clean)     # leaving on an error: no wait for the others (torchrun stops them)
    code = 0 if summary["status"] == "finished" else 128 + int(signal.Signals[summary["signal"]])
    if not main_process:
        return code
    if args.json:
        from sgraf.cli.arguments import print_json

        print_json({**summary, "epochs": config.epochs})
        return code
    if summary["status"] == "interrupted":
        print(f"stopped by {summary['signal']} in epoch {summary['epoch'] + 1} of {config.epochs} ({summary['epoch']} "
              f"done, as sgraf runs counts), step {summary['global_step']}; last.pt saved. Continue with: "
              f"{_resume_command(out, world)}")
        return code
    epochs = summary["epoch"]
    if summary["stopped_early"]:
        print(f"stopped early after {epochs} of {config.epochs} epochs ({summary['global_step']} steps; no better dev "
              f"rsum in the last {epochs - summary['best_epoch']}): best dev rsum {summary['best_rsum']:.2f} at epoch "
              f"{summary['best_epoch']}, step {summary['best_step']}; run folder {out}")
        return 0
    print(f"finished {epochs} epoch{'' if epochs == 1 else 's'} ({summary['global_step']} steps): best dev rsum "
          f"{summary['best_rsum']:.2f} at step {summary['best_step']}; run folder {out}")
    return 0


def _resume_command(out: str, world: int) -> str:
    """The command that continues the run, under torchrun with its processes where it ran under it
    (a single-process resume of a 2-process run had been suggested)."""
    resume = f"sgraf train --resume {shlex.quote(str(out))}"
    if world <= 1:
        return resume
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = f" on each of its {world // per_node} nodes" if per_node < world else ""
    return f"torchrun --nproc-per-node {per_node} -m {resume}{nodes}"
