"""The Triton kernel of `sgraf.kernels.filtration` (imported at its first use: Triton is an
optional dependency, never imported by `import sgraf`)."""

import triton
import triton.language as tl


@triton.jit
def filter_kernel(nodes, mask, weight, bias, scale, shift, out, n_pairs, n_cap, n_nodes, dim,
                  stride_img, stride_cap, stride_node,
                  NODES: tl.constexpr, DIM: tl.constexpr, PAIRS: tl.constexpr, EPSILON: tl.constexpr):
    """SAF's pooled vector of `PAIRS` (image, caption) pairs, one after the other: `nodes`
    (n_img, n_cap, P, m) in its dtype, `mask` (n_cap, P) uint8, `weight` (m,), `bias`, `scale`
    and `shift` (1,) float32, `out` (n_img x n_cap, m) float32. A pair's nodes are rows (padded to
    `NODES`), their features columns (padded to `DIM`); everything after the load in float32."""
    ns = tl.arange(0, NODES)
    ds = tl.arange(0, DIM)
    n_ok = ns < n_nodes
    d_ok = ds < dim
    w = tl.load(weight + ds, mask=d_ok, other=0.0)
    b = tl.load(bias)
    a = tl.load(scale)
    c = tl.load(shift)
    for index in tl.static_range(PAIRS):
        # a pair's offset in 64 bits (a block's nodes pass 2**31 values)
        pair = (tl.program_id(0) * PAIRS + index).to(tl.int64)
        rows = n_ok & (ns * 0 + pair < n_pairs)                              # (a block's mask)
        cap = pair % n_cap
        valid = tl.load(mask + cap * n_nodes + ns, mask=rows, other=0).to(tl.float32)
        at = (pair // n_cap) * stride_img + cap * stride_cap
        x = tl.load(nodes + at + ns[:, None] * stride_node + ds[None, :], mask=rows[:, None] & d_ok[None, :],
                    other=0.0).to(tl.float32)
        logits = tl.sum(x * w[None, :], axis=1) + b                          # W_f s + b_f
        beta = tl.sigmoid(logits * a + c) * valid                            # the eval BatchNorm folded in
        beta = beta / (tl.sum(beta, axis=0) + EPSILON)                       # l1norm over the valid nodes
        pooled = tl.sum(beta[:, None] * x, axis=0)
        pooled = pooled * (1.0 / (tl.sqrt(tl.sum(pooled * pooled, axis=0)) + EPSILON))
        tl.store(out + pair * dim + ds, pooled, mask=d_ok & (ds * 0 + pair < n_pairs))
