"""The `sgraf` command in a fresh process, for the benchmarks that time whole commands.

It starts and ends as the console script does: nothing is imported before the command line
runs (so the command's own imports, its caption prefetch and its `--timings` stages are a
user's), and it ends through `sgraf.cli.exit_process`. Then it writes
`{"code", "peak_mb", "tokenize_s"}` to REPORT.json (peak resident memory; the seconds the
command spent getting its captions' token ids).

    python command_child.py REPORT.json [--stand-in] -- evaluate --checkpoint ... --data ...

`--stand-in` replaces the device's work in `sgraf evaluate`: the model's encoders return at once
(an empty tensor one feature wide, no global vectors) and the scorer returns a random matrix of
the split's shape, which leaves the host side alone (`bench_evaluate_host.py`), the encoding's
included: the features read off their memory map and checked, the captions padded and bucketed.
`bench_eval.py` runs the real command.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def stand_in(spent: list[float]) -> None:
    """Install the stand-ins once the command has made its imports (it imports PyTorch itself);
    at once for an earlier sgraf (`--baseline`), whose command line imported PyTorch while parsing."""
    import sgraf.cli.evaluate as command

    def install() -> None:
        import numpy as np
        import torch

        import sgraf.model.sgraf as model
        import sgraf.scoring as scoring

        def encode_images(self, images, boxes=None):
            return images.new_empty(*images.shape[:2], 1)

        def encode_captions(self, captions, lengths):
            return captions.new_empty(len(captions), int(max(lengths)), 1, dtype=torch.float32)

        model.SGRAF.encode_images, model.SGRAF.encode_captions = encode_images, encode_captions
        model.SGRAF.image_globals = model.SGRAF.caption_globals = lambda self, *args: None
        real_tokenize = scoring.tokenize_captions

        def tokenize(captions, vocab, *rest):
            begin = time.perf_counter()
            ids = real_tokenize(captions, vocab, *rest)
            spent.append(time.perf_counter() - begin)
            return ids

        scoring.tokenize_captions = tokenize

        def score_matrix(models, encoded, keep_on_device=False, **options):
            # a random matrix of the split's shape, as the real one returns it (a tensor where it was
            # scored when `keep_on_device`, as `evaluate_split` asks since session 19; else numpy)
            sims = np.random.default_rng(0).random((encoded[0].n_images, encoded[0].n_captions), dtype=np.float32)
            return torch.from_numpy(sims) if keep_on_device else sims

        scoring.score_matrix = score_matrix

    real = getattr(command, "_evaluate", None)
    if real is None:
        install()
        return

    def evaluate(*args, **kwargs):
        install()
        return real(*args, **kwargs)

    command._evaluate = evaluate


def main() -> None:
    report, *rest = sys.argv[1:]
    stand = rest[:1] == ["--stand-in"]
    rest = rest[1:] if stand else rest
    if rest[:1] != ["--"]:
        raise SystemExit("usage: command_child.py REPORT.json [--stand-in] -- SGRAF_ARGS...")
    spent: list[float] = []
    if stand:
        stand_in(spent)
    import sgraf.cli as cli

    code = cli.main(rest[1:])
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    Path(report).write_text(json.dumps({"code": code, "peak_mb": peak_mb, "tokenize_s": sum(spent)}))
    # an earlier checkout (bench_eval.py --baseline) may end the usual way
    getattr(cli, "exit_process", sys.exit)(code)


if __name__ == "__main__":
    main()
