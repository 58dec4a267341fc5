"""Data: the SCAN precomp layout, vocabularies, converters and the embedded benchmark.

- `sgraf.data.vocab`: `Vocabulary`, `load_vocab`, `build_vocab` (the authors' JSON and tokens).
- `sgraf.data.precomp`: `PrecompSplit` (memory-mapped, validated), `PrecompDataset`,
  `collate_batch` -> `Batch`, `make_loader`, `available_splits`.
- `sgraf.data.convert`: bottom-up-attention TSV -> precomp.
- `sgraf.data.features`: backbone interface, EfficientNet-Lite0 grid features (`sgraf[vision]`).
- `sgraf.data.benchmark`: the embedded benchmark generator; `sgraf.data.render` draws it.

Submodules are imported on demand so that `import sgraf.data.vocab` stays light.
"""
