"""How large is a place model's place term beside the score it is added to?

A `positions=place` model adds the place term to each head's logit before the sigmoid
(docs/positions.md). This probe scores the first `--images` pictures of a split against their
captions (every picture against every caption) and prints, per checkpoint, the mean and sd of the
heads' logits (their FC's output) and of the term, the largest |term|, and the mean score of all
pairs and of the true pairs. A healthy SGR + place of the demo has a term of sd 0.1-0.2 beside
logits of sd 1.4; the one that stalled on its plateau had 0.72, with a largest |term| of 4.8.

With `--diagnose` it scores the whole split instead, the checkpoints as one ensemble (their scores
averaged, as `sgraf evaluate` does), twice: as trained, and with the place term removed at test
time (each head's score sigmoid(logit) alone); and prints the Winoground group score per kind of
twin of each (`sgraf diagnose`; a split written by `sgraf generate`) and the rsum. What the term
adds or takes away on each kind is the difference. `--sharpness 1 2 4` adds a pass per value,
the places read at that `place_sharpness` (how the demo's 2 was chosen, on the dev split).

    python benchmarks/probe_place_term.py --data sgraf-demo/data runs/sgr-pos/best.pt runs/saf-pos/best.pt
    python benchmarks/probe_place_term.py --data sgraf-demo/data --split test --diagnose runs/sgr-pos/best.pt runs/saf-pos/best.pt
    python benchmarks/probe_place_term.py --data sgraf-demo/data --split dev --diagnose runs/sgr-pos/best.pt runs/saf-pos/best.pt --sharpness 1 2 4

With `--twins KIND` (binding, attribute, relation, count) it takes every caption of a twin pair of
that kind that is false of the twin, scores it on its own picture and on the twin with each
checkpoint, and prints how much the term differs between the two pictures (mean |difference|),
and the words whose shares of the term (e_u . (p_u - 1/2), `PlaceTerm.word_shares`) differ most.

    python benchmarks/probe_place_term.py --data sgraf-demo/data --split test --twins attribute runs/saf-pos/best.pt
"""

from __future__ import annotations

import argparse
import sys
from unittest import mock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", help="place models (positions=place)")
    parser.add_argument("--data", required=True, help="a precomp folder with boxes (sgraf generate)")
    parser.add_argument("--split", default="dev")
    parser.add_argument("--images", type=int, default=40, help="the first N pictures and their captions")
    parser.add_argument("--diagnose", action="store_true",
                        help="group scores of the ensemble with and without the term, on the whole split")
    parser.add_argument("--sharpness", type=float, nargs="+", default=(),
                        help="with --diagnose, also score with the places read at each of these "
                             "place_sharpness values (>= 1)")
    parser.add_argument("--twins", choices=("binding", "attribute", "relation", "count"),
                        help="where the term differs between the two pictures of twins of this kind")
    args = parser.parse_args(argv)
    if args.diagnose:
        return _diagnose(args)
    if args.twins:
        return _twins(args)

    import numpy as np
    import torch

    import sgraf.model.sgraf as sgraf_model
    from sgraf.api import Matcher
    from sgraf.data.precomp import PrecompSplit, read_captions

    split = PrecompSplit(args.data, args.split)
    n = min(args.images, split.n_images)
    per_image = split.caps_per_image
    features = np.asarray(split.images[:n])
    boxes = split.boxes
    if boxes is None:
        print(f"error: {args.data}: the {args.split} split has no boxes; a place model needs them", file=sys.stderr)
        return 2
    texts = read_captions(split.caps_path)[: per_image * n]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    score = sgraf_model._score

    def recording(logits: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
        if offset is not None:
            seen.append((logits.detach().flatten().float(), offset.detach().flatten().float()))
        return score(logits, offset)

    for path in args.checkpoints:
        seen.clear()
        matcher = Matcher.load(path)
        with mock.patch.object(sgraf_model, "_score", recording):
            scores = matcher.score(features, texts, boxes=boxes[:n])
        if not seen:
            print(f"{path}: not a place model (no place term)")
            continue
        logits = torch.cat([logit for logit, _ in seen])
        term = torch.cat([offset for _, offset in seen])
        true = np.mean([scores[i, per_image * i: per_image * (i + 1)].mean() for i in range(n)])
        print(f"{path}: logit mean {logits.mean():.2f} sd {logits.std():.2f} | term mean {term.mean():.2f} "
              f"sd {term.std():.2f}, largest |term| {term.abs().max():.2f} | score mean {scores.mean():.3f}, "
              f"true pairs {true:.3f}")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    import sgraf.model.sgraf as sgraf_model
    from sgraf.checkpoint import load_model
    from sgraf.data.benchmark import VARIANTS, load_scenes
    from sgraf.diagnose import winoground
    from sgraf.evaluate import open_split, score_split
    from sgraf.metrics import i2t, rsum, t2i

    models = [load_model(path) for path in args.checkpoints]
    if any(value < 1 for value in args.sharpness):
        print(f"error: --sharpness values must be >= 1, got {list(args.sharpness)}", file=sys.stderr)
        return 2
    split = open_split(args.data, args.split)
    scenes = load_scenes(args.data, args.split)
    score = sgraf_model._score
    removed = lambda logits, offset: score(logits, None)   # noqa: E731
    trained = [model.sim_enc.place_sharpness for model in models]
    passes = [("with the term", score, trained), ("term removed", removed, trained)]
    passes += [(f"read at {value:g} x lam", score, [value] * len(models)) for value in args.sharpness]
    rows = {}
    for name, patch, sharpness in passes:
        for model, value in zip(models, sharpness):
            model.sim_enc.place_sharpness = value
        with mock.patch.object(sgraf_model, "_score", patch):
            sims = score_split(models, split, models[0].vocab)
        result = winoground(sims, scenes)
        total = rsum(i2t(sims, split.caps_per_image), t2i(sims, split.caps_per_image))
        rows[name] = [result[kind]["group"] for kind in (*VARIANTS, "all")] + [total / 100]  # None: no pairs
    print(f"group score (%) and rsum of {' + '.join(args.checkpoints)} on {args.data} {args.split}")
    print(f"{'':16}" + "".join(f"{kind:>11}" for kind in (*VARIANTS, "all", "rsum")))
    for name, values in rows.items():
        print(f"{name:16}" + "".join(f"{'-':>11}" if value is None else f"{100 * value:11.1f}" for value in values))
    return 0


def _twins(args: argparse.Namespace) -> int:
    import collections

    import numpy as np
    import torch

    from sgraf.checkpoint import load_model
    from sgraf.data.benchmark import load_scenes
    from sgraf.diagnose import twin_pairs
    from sgraf.evaluate import open_split
    from sgraf.model.positions import PlaceTerm
    from sgraf.model.sgraf import _masked_words
    from sgraf.model.similarity import region_attention

    split = open_split(args.data, args.split)
    scenes = load_scenes(args.data, args.split)
    pairs = []   # (the caption's picture, the twin it is false of, the caption)
    for kind, base, twin, of_base, of_twin in twin_pairs(scenes, split.caps_per_image):
        if kind == args.twins:
            pairs += [(base, twin, caption) for caption in of_base] + [(twin, base, caption) for caption in of_twin]
    boxes = torch.from_numpy(split.boxes)
    for path in args.checkpoints:
        model = load_model(path)
        if not getattr(model, "has_places", False):
            print(f"{path}: not a place model (no place term)")
            continue
        per_word, seen, differences = collections.Counter(), collections.Counter(), []
        with torch.no_grad():
            for own, twin, caption in pairs:
                ids = model.vocab.encode(split.captions[caption])
                lengths = torch.tensor([len(ids)])
                images = torch.from_numpy(np.asarray(split.images[[own, twin]])).float()
                regions, centres = model.split_places(model.encode_images(images, boxes[[own, twin]]))
                words, mask, _ = _masked_words(model.encode_captions(torch.tensor([ids]), lengths), lengths)
                places = PlaceTerm.places(region_attention(regions, words, model.sim_enc.place_smooth), centres)
                term = model.sim_enc.place_term   # the shares of the term's value (a penalty's too)
                shares = term.value_shares(PlaceTerm.word_shares(places, term.word_directions(words, mask))[:, 0])
                differences.append(float((shares[0].sum() - shares[1].sum()).abs()))
                for word, change in zip(split.captions[caption].split(), (shares[0] - shares[1]).abs().tolist()):
                    per_word[word] += change
                    seen[word] += 1
        mean = float(np.mean(differences)) if differences else float("nan")
        print(f"{path}: {len(pairs)} {args.twins} captions false of their twin; the term differs between the "
              f"two pictures by {mean:.3f} on average")
        for word, total in per_word.most_common(8):
            print(f"  {word:12} share differs by {total / seen[word]:.3f} on average ({seen[word]} times)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
