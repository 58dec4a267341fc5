"""The Triton kernel of `sgraf.kernels.attention` (imported at its first use: Triton is an
optional dependency, never imported by `import sgraf`)."""

import triton
import triton.language as tl


@triton.jit
def attention_kernel(relevance, gram, out, n_cap, n_words, n_rows, smooth, n_regions: tl.constexpr,
                     REGIONS: tl.constexpr, WORDS: tl.constexpr, CAPTIONS: tl.constexpr, EPSILON: tl.constexpr):
    """One image's attention over a tile of `CAPTIONS` captions: `relevance` (n_img, K, n_rows)
    in the nodes' dtype, n_rows = n_cap x n_words, `gram` (n_img, K, K) and `out` (n_img, K,
    n_rows) float32. Rows are regions (padded to `REGIONS`), columns the tile's (caption, word)
    pairs, each caption's words padded to `WORDS`; everything after the load in float32. The
    region count K is a compile-time constant (a model's; the loop over the regions takes it as
    its bound, which Triton 3.6's interpreter needs)."""
    COLUMNS: tl.constexpr = CAPTIONS * WORDS
    # an image's offset in 64 bits (a block's attention passes 2**31 values), offsets within it in 32
    image = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, COLUMNS)
    caption = tl.program_id(1) * CAPTIONS + columns // WORDS
    word = columns % WORDS
    column_ok = (caption < n_cap) & (word < n_words)
    at = caption * n_words + word                                    # the column in the block's rows
    ks = tl.arange(0, REGIONS)
    k_ok = ks < n_regions
    inside = k_ok[:, None] & column_ok[None, :]
    base = image * n_regions * n_rows
    relevance += base
    out += base
    x = tl.load(relevance + ks[:, None] * n_rows + at[None, :], mask=inside, other=0.0).to(tl.float32)
    x = tl.where(x > 0, x, x * 0.1)                                    # leaky ReLU, slope 0.1
    # each (region, caption)'s l2 norm over the caption's words, and lambda / (norm + eps) applied
    per_caption = tl.reshape(x, (REGIONS, CAPTIONS, WORDS))
    norm = tl.sqrt(tl.sum(per_caption * per_caption, axis=2))         # (REGIONS, CAPTIONS)
    scale = (1.0 / (norm + EPSILON)) * smooth
    x = tl.reshape(per_caption * scale[:, :, None], (REGIONS, COLUMNS))
    # the softmax over the regions (the padded ones left out)
    x = tl.where(k_ok[:, None], x, float("-inf"))
    top = tl.max(x, axis=0)
    e = tl.exp(x - top[None, :])
    total = tl.sum(e, axis=0)
    attn = e / total[None, :]
    # |a_j|^2 = attn_j^T G attn_j from the image's Gram matrix G, one region k at a time:
    # (G attn)_kj from G's row k, times attn_kj, whose row is computed again from the relevance
    # (a tile's rows cannot be indexed; a (REGIONS, K) product with FMA held too many registers)
    square = tl.zeros((COLUMNS,), dtype=tl.float32)
    for k in range(0, n_regions):
        g = tl.load(gram + image * n_regions * n_regions + k * n_regions + ks, mask=k_ok, other=0.0)
        spread = tl.sum(g[:, None] * attn, axis=0)                                 # (G attn)_kj
        row = tl.load(relevance + k * n_rows + at, mask=column_ok, other=0.0).to(tl.float32)
        row = tl.reshape(tl.where(row > 0, row, row * 0.1), (CAPTIONS, WORDS))
        row_scale = (1.0 / (tl.sqrt(tl.sum(row * row, axis=1)) + EPSILON)) * smooth
        row = tl.reshape(row * row_scale[:, None], (COLUMNS,))
        square += (tl.exp(row - top) / total) * spread
    scaled = attn * (1.0 / (tl.sqrt(tl.maximum(square, 0.0)) + EPSILON))[None, :]
    tl.store(out + ks[:, None] * n_rows + at[None, :], scaled, mask=inside)
