"""The Triton kernel of `sgraf.kernels.graph_steps` (imported at its first use: Triton is an
optional dependency, never imported by `import sgraf`)."""

import triton
import triton.language as tl


@triton.jit
def narrow(x, low: tl.constexpr, EMULATE: tl.constexpr):
    """`x` (float32) rounded to the nodes' dtype as PyTorch's kernels write it. Triton's
    interpreter truncates a cast to bf16, so there (EMULATE) the rounding to nearest even is
    done on the bits and the value stays float32 (the interpreter multiplies bf16 tiles
    wrongly too)."""
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(low)


@triton.jit
def edge_weights(x, source, row_ok, keys_ok, key_add, feats, bilinear, key_term, step, low: tl.constexpr,
                 QUERIES: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, DIM_TILE: tl.constexpr,
                 CHUNK: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr,
                 EMULATE: tl.constexpr):
    """The edges (QUERIES, ROWS) of the query nodes `x` (QUERIES, DIM_TILE) against the program's
    nodes at `source` (ROWS rows): the folded queries `CHUNK` output features at a time, their
    logits against the nodes, the keys `keys_ok` allows (and the caption's mask `key_add`), the
    softmax; rounded where the eager steps round."""
    feat_ok = feats < DIM
    logits = tl.zeros((QUERIES, ROWS), dtype=tl.float32)
    for start in range(0, DIM_TILE, CHUNK):
        outs = start + tl.arange(0, CHUNK)
        out_ok = outs < DIM
        w = tl.load(bilinear + step * DIM * DIM + outs[None, :] * DIM + feats[:, None],
                    mask=feat_ok[:, None] & out_ok[None, :], other=0.0)                     # (DIM_TILE, CHUNK)
        keys = tl.load(source[:, None] + outs[None, :], mask=row_ok[:, None] & out_ok[None, :], other=0.0)
        if WIDEN:
            w = w.to(tl.float32)
            keys = keys.to(tl.float32)
        query = tl.dot(x, w, input_precision=PRECISION, out_dtype=tl.float32)
        query += tl.load(key_term + step * DIM + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
        query = narrow(query, low, EMULATE)                                        # rounded as F.linear's
        logits += tl.dot(query, tl.trans(keys), input_precision=PRECISION, out_dtype=tl.float32)
    logits = narrow(logits, low, EMULATE).to(tl.float32)                           # the logits' matmul output
    if HAS_MASK:
        logits += key_add.to(tl.float32)[None, :]
    logits = tl.where(keys_ok, logits, float("-inf"))
    top = tl.max(logits, axis=1)
    edges = tl.exp(logits - top[:, None])
    return narrow(edges / tl.sum(edges, axis=1)[:, None], low, EMULATE)           # the softmax's output


@triton.jit
def aggregated(edges, source, row_ok, at_rows, scratch, feats, low: tl.constexpr, QUERIES: tl.constexpr,
               DIM: tl.constexpr, DIM_TILE: tl.constexpr, CHUNK: tl.constexpr, PRECISION: tl.constexpr,
               WIDEN: tl.constexpr, EMULATE: tl.constexpr):
    """The aggregates `edges . nodes` (QUERIES, DIM_TILE) of the nodes at `source`, written
    `CHUNK` features at a time to the scratch rows `at_rows` (the first QUERIES of the program's,
    which `source` may be: a feature of the aggregate reads that feature of the nodes alone, so
    each chunk overwrites what it read) and read back whole."""
    for start in range(0, DIM_TILE, CHUNK):
        outs = start + tl.arange(0, CHUNK)
        values = tl.load(source[:, None] + outs[None, :], mask=row_ok[:, None] & (outs < DIM)[None, :], other=0.0)
        if WIDEN:
            values = values.to(tl.float32)
        part = narrow(tl.dot(edges, values, input_precision=PRECISION, out_dtype=tl.float32), low, EMULATE)
        tl.debug_barrier()          # the chunk's nodes are read by every thread before they are overwritten
        tl.store(scratch + at_rows[:, None] + outs[None, :], part.to(low))
    tl.debug_barrier()
    aggregate = tl.load(scratch + at_rows[:, None] + feats[None, :])                      # (QUERIES, DIM_TILE)
    if WIDEN:
        aggregate = aggregate.to(tl.float32)
    tl.debug_barrier()              # every thread holds the aggregates: the new nodes may overwrite them
    return aggregate


@triton.jit
def updated(aggregate, start, feats, weight, bias, step, low: tl.constexpr, DIM: tl.constexpr,
            CHUNK: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, EMULATE: tl.constexpr):
    """`ReLU(W_r . + b_r)` of the aggregates for the `CHUNK` output features from `start`,
    rounded to the nodes' dtype (as float32)."""
    outs = start + tl.arange(0, CHUNK)
    out_ok = outs < DIM
    w = tl.load(weight + step * DIM * DIM + outs[None, :] * DIM + feats[:, None],
                mask=(feats < DIM)[:, None] & out_ok[None, :], other=0.0)                    # (DIM_TILE, CHUNK)
    if WIDEN:
        w = w.to(tl.float32)
    new = tl.dot(aggregate, w, input_precision=PRECISION, out_dtype=tl.float32)
    new += tl.load(bias + step * DIM + outs, mask=out_ok, other=0.0).to(tl.float32)[None, :]
    return narrow(tl.maximum(new, 0.0), low, EMULATE)


@triton.jit
def graph_steps_kernel(graphs, blocked, bilinear, key_term, weight, bias, scratch, out,
                       n_graphs, n_cap, n_nodes,
                       STEPS: tl.constexpr, DIM: tl.constexpr, DIM_TILE: tl.constexpr, NODES: tl.constexpr,
                       ROWS: tl.constexpr, GLOBALS: tl.constexpr,
                       CHUNK: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
                       WIDEN: tl.constexpr, EMULATE: tl.constexpr):
    """Every reasoning step over the graphs of `ROWS // NODES` graphs (each padded to `NODES` rows)
    per program, through this program's `ROWS` scratch rows; the last step for each graph's
    global node alone (the read-out), its rows gathered into a tile of `GLOBALS` rows (at least
    16, what a tensor-core product takes), as the eager steps update only the read-out."""
    program = tl.program_id(0).to(tl.int64)          # 64-bit offsets: a block's nodes pass 2**31 values
    local = tl.arange(0, ROWS)
    graph = program * (ROWS // NODES) + local // NODES
    node = local % NODES
    row_ok = (node < n_nodes) & (graph < n_graphs)
    feats = tl.arange(0, DIM_TILE)                                # the node width, padded to a power of two
    feat_ok = feats < DIM
    at_graph = graph * n_nodes * DIM + node * DIM               # (ROWS,) a row's place in `graphs`
    at_scratch = (program * ROWS + local) * DIM_TILE             # ... in this program's scratch rows
    low: tl.constexpr = graphs.dtype.element_ty
    # keys: a node of the query's own graph, not padding; the caption's mask added as the eager route adds it
    keys_ok = ((local[:, None] // NODES) == (local[None, :] // NODES)) & (node < n_nodes)[None, :]
    key_add = tl.zeros((ROWS,), dtype=tl.float32)
    if HAS_MASK:
        key_add = tl.load(blocked + (graph % n_cap) * n_nodes + node, mask=node < n_nodes, other=0.0).to(tl.float32)
    for step in tl.static_range(STEPS - 1):
        if step == 0:
            source = graphs + at_graph
        else:
            source = scratch + at_scratch
        x = tl.load(source[:, None] + feats[None, :], mask=row_ok[:, None] & feat_ok[None, :], other=0.0)
        if WIDEN:
            x = x.to(tl.float32)
        edges = edge_weights(x, source, row_ok, keys_ok, key_add, feats, bilinear, key_term, step, low, ROWS, ROWS,
                             DIM, DIM_TILE, CHUNK, HAS_MASK, PRECISION, WIDEN, EMULATE)
        aggregate = aggregated(edges, source, row_ok, at_scratch, scratch, feats, low, ROWS, DIM, DIM_TILE, CHUNK,
                               PRECISION, WIDEN, EMULATE)
        for start in range(0, DIM_TILE, CHUNK):
            new = updated(aggregate, start, feats, weight, bias, step, low, DIM, CHUNK, PRECISION, WIDEN, EMULATE)
            tl.store(scratch + at_scratch[:, None] + (start + tl.arange(0, CHUNK))[None, :], new.to(low))
        tl.debug_barrier()          # the new nodes are written before the next step reads them
    # the last step: each graph's global node (its row 0) alone, as queries against all the keys
    step = STEPS - 1
    if step == 0:
        source = graphs + at_graph
    else:
        source = scratch + at_scratch
    mine = tl.arange(0, GLOBALS)                                  # a global node per row; padding past them
    own = program * (ROWS // NODES) + mine
    mine_ok = (mine < ROWS // NODES) & (own < n_graphs)
    if step == 0:
        at_own = graphs + own * n_nodes * DIM
    else:
        at_own = scratch + (program * ROWS + mine * NODES) * DIM_TILE
    x = tl.load(at_own[:, None] + feats[None, :], mask=mine_ok[:, None] & feat_ok[None, :], other=0.0)
    if WIDEN:
        x = x.to(tl.float32)
    # a global node's keys are its own graph's nodes; a padding row takes every key (finite, not stored)
    own_keys = ((mine[:, None] == (local[None, :] // NODES)) & (node < n_nodes)[None, :]) | ~mine_ok[:, None]
    edges = edge_weights(x, source, row_ok, own_keys, key_add, feats, bilinear, key_term, step, low, GLOBALS, ROWS,
                         DIM, DIM_TILE, CHUNK, HAS_MASK, PRECISION, WIDEN, EMULATE)
    # the global nodes' aggregates in this program's first GLOBALS scratch rows
    aggregate = aggregated(edges, source, row_ok, (program * ROWS + mine) * DIM_TILE, scratch, feats, low, GLOBALS,
                           DIM, DIM_TILE, CHUNK, PRECISION, WIDEN, EMULATE)
    for start in range(0, DIM_TILE, CHUNK):
        new = updated(aggregate, start, feats, weight, bias, step, low, DIM, CHUNK, PRECISION, WIDEN, EMULATE)
        outs = start + tl.arange(0, CHUNK)
        tl.store(out + own[:, None] * DIM + outs[None, :], new.to(tl.float32),
                 mask=mine_ok[:, None] & (outs < DIM)[None, :])
