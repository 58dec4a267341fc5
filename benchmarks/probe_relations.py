"""Can a model learn relations at all? Fit a checkpoint on relation twins alone and watch.

The embedded benchmark's relation twins (`sgraf generate`: a base picture and the picture with two
of its objects exchanged) are where every model of the study is below chance. This probe asks
whether that is the training signal or the model: it takes the relation pairs of the TRAINING
split (base b, twin n, a caption of b false of n and one of n false of b), holds out the first
`--held` pairs, and fine-tunes the checkpoint on the others alone: batches of `--pairs` twin pairs
(both pictures, one relation caption of each), the authors' hardest-negative hinge. Every
`--every` steps it prints the share of caption-picture comparisons it gets right,
s(c_b, b) > s(c_b, n) and s(c_n, n) > s(c_n, b), on 60 trained pairs and on the held-out ones
(0.5: position-blind).

    python benchmarks/probe_relations.py --checkpoint runs/saf-pos/best.pt --data sgraf-demo/data
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a model with positions (or without, for comparison)")
    parser.add_argument("--data", required=True, help="a folder written by sgraf generate")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--pairs", type=int, default=8, help="twin pairs per batch")
    parser.add_argument("--held", type=int, default=60, help="relation pairs held out of the fine-tuning")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    from sgraf.checkpoint import load_model
    from sgraf.data.benchmark import load_scenes
    from sgraf.data.precomp import PrecompSplit
    from sgraf.model.loss import ranking_loss

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = load_model(args.checkpoint)
    scenes = load_scenes(args.data, "train")
    split = PrecompSplit(args.data, "train")
    per = split.caps_per_image
    images = torch.from_numpy(np.array(split.images, dtype=np.float32))
    boxes = split.read_boxes(required=model.needs_boxes)
    boxes = None if boxes is None else torch.from_numpy(np.array(boxes))

    variants: dict[int, dict[str, int]] = {}
    for row in scenes:
        variants.setdefault(row["family"], {})[row["variant"]] = row["index"]
    pairs = []   # (b, n, captions of b false of n, captions of n false of b)
    for members in variants.values():
        if "base" in members and "relation" in members:
            b, n = members["base"], members["relation"]
            of_b = [b * per + j for j, wrong in enumerate(scenes[b]["false_for"]) if n in wrong]
            of_n = [n * per + j for j, wrong in enumerate(scenes[n]["false_for"]) if b in wrong]
            if of_b and of_n:
                pairs.append((b, n, of_b, of_n))
    if len(pairs) <= args.held + args.pairs:
        print(f"{args.data}: {len(pairs)} relation pairs in train, too few for --held {args.held} and --pairs "
              f"{args.pairs}", file=sys.stderr)
        return 2
    held, trained = pairs[: args.held], pairs[args.held:]

    def encode(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [model.vocab.encode(scenes[k // per]["captions"][k % per]) for k in indices]
        tokens = torch.zeros(len(ids), max(map(len, ids)), dtype=torch.int64)
        for row, x in enumerate(ids):
            tokens[row, : len(x)] = torch.as_tensor(x)
        return tokens, torch.tensor([len(x) for x in ids])

    def picked(indices: list[int]) -> torch.Tensor | None:
        return None if boxes is None else boxes[indices]

    def share(sample: list[tuple]) -> float:
        model.eval()
        right = []
        with torch.no_grad():
            for b, n, of_b, of_n in sample:
                tokens, lengths = encode([of_b[0], of_n[0]])
                s = model.score(images[[b, n]], tokens, lengths, boxes=picked([b, n]))
                right += [bool(s[0, 0] > s[1, 0]), bool(s[1, 1] > s[0, 1])]
        return float(np.mean(right))

    print(f"{len(pairs)} relation pairs in train: fine-tuning on {len(trained)}, {len(held)} held out; "
          f"lr {args.lr}, {args.pairs} pairs a batch")
    print(f"step 0: right on trained pairs {share(trained[:60]):.3f}, held out {share(held):.3f}")
    rng = np.random.default_rng(args.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        model.train()
        image_ids, caption_ids = [], []
        for index in rng.choice(len(trained), args.pairs, replace=False):
            b, n, of_b, of_n = trained[index]
            image_ids += [b, n]
            caption_ids += [of_b[rng.integers(len(of_b))], of_n[rng.integers(len(of_n))]]
        tokens, lengths = encode(caption_ids)
        scores = model(images[image_ids], tokens, lengths, boxes=picked(image_ids))
        scores = scores if isinstance(scores, torch.Tensor) else sum(scores.values())
        loss = ranking_loss(scores.float(), 0.2, True)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
        optimizer.step()
        if step % args.every == 0:
            print(f"step {step}: loss {loss.item():.3f}, right on trained pairs {share(trained[:60]):.3f}, "
                  f"held out {share(held):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
