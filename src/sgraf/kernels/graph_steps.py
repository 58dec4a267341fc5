"""SGR's reasoning steps over every graph of an eval scoring block (Eq. 6-8), by the faster of
two routes on this device.

`fast_graph_reasoning` is the one dispatch the model calls (`SimilarityEncoder.fast_head_scores`,
with the weights of `fold_steps`); `sgraf.model.reasoning.graph_reasoning` is the math it is
held to. Each (image, caption) pair is a graph of a dozen nodes of 256 values. The eager route
(per step, the folded query matmul, the edge step of `sgraf.kernels.edges` and
`ReLU(W_r E N + b_r)`) writes each step's queries, logits, edges, aggregates and new nodes to
memory and reads them back: at a block of 256 images x 1,024
captions of 13 words, about 21 GB per step in bf16 (`benchmarks/launch_counts.py --traffic`),
where the nodes themselves are 1.9 GB.

- `eager`: those operations.
- `fused`: one Triton kernel for all the steps. Each program takes the nodes of a few graphs
  (`ROWS` rows, each graph padded to a power of two), and per step computes the queries
  `CHUNK` output features at a time, accumulating their logits against the nodes, the masked
  softmax within each graph, the aggregates and `ReLU(W_r . + b_r)`, writing the new nodes to a
  scratch area of its own (read back by the next step, mostly from the L2 cache). The last step
  computes the global nodes alone, as the eager route does: the program's graphs' global rows
  gathered into one tile of at least 16 rows (`GLOBALS`), a quarter of a full step's products
  for a 64-row tile; it writes their vectors. The kernel rounds where the eager route rounds
  (queries, logits, edges, aggregates and nodes to the nodes' dtype), so the two agree to the
  accumulation order.

`measure_step_route(device, dtype, dim, steps)` times the eager route and the kernel with each
of `TILES` once per device, dtype and sizes on a block-shaped probe (`sgraf.kernels.tuning`;
`SGRAF.tune_eval` calls it before a large split on a CUDA device with Triton) and keeps `eager`
unless a tile is more than 20 % faster. `step_route` then returns the stored choice without
measuring. `SGRAF_STEP_ROUTE=eager|fused` forces one. Elsewhere (the CPU, a compiled graph,
`plan.emulate_gpu`, no Triton), in float32 (`DTYPES`), for graphs of more than `MAX_NODES` nodes
and for a model without a global node, the route is `eager` (`applies`). A node width that is
not a power of two is padded to one inside the kernel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from sgraf.kernels import edges, plan
from sgraf.kernels.cpu import fast_linear
from sgraf.kernels.fused_routes import FP_FUSION, ROUTES, FusedRoutes, dtype_key, fusable


MAX_NODES = 64                       # graphs of more nodes (captions of 64 words or more): eager
# the nodes' dtypes the kernel takes. In float32 (exact products on the CUDA cores) Triton 3.9
# took about a minute per tile to compile it for sm_90 and spilled 16-99 KB of registers, so
# float32 stays eager without a probe (its block is bound by arithmetic, not memory, anyway)
DTYPES = (torch.bfloat16, torch.float16)
# the probe: (images, captions, nodes) of a scoring block's middle length bucket
PROBE_GRAPHS = (64, 256, 14)
# the kernel's tiles: (rows of nodes per program, output features per matmul step, warps,
# pipeline stages). The first is "fused"'s; the probe times each as a route of its own
TILES = ((64, 32, 8, 1), (64, 32, 4, 1), (64, 64, 8, 1), (32, 32, 4, 1))
ROUTE = FusedRoutes("SGRAF_STEP_ROUTE", "reasoning-step", TILES)
MEASURED = ROUTE.measured


class FoldedSteps(list):
    """`fold_steps`' per-step weight tuples, and the same weights as the
    kernel reads them: each kind stacked over the steps (`stacked`, built at its first use and
    kept with the tuples, which never change, so a model's cached weights stack once, not on
    every scoring block)."""

    @functools.cached_property
    def stacked(self) -> tuple[torch.Tensor, ...]:
        """(bilinear_t (S, m, m), key_term (S, m), W_r (S, m, m), b_r (S, m)), contiguous."""
        return tuple(torch.stack([step[kind] for step in self]).contiguous() for kind in range(4))


def fold_steps(steps: Iterable[Any], low: torch.dtype) -> FoldedSteps:
    """Per step of `steps` (the model's `GraphReasoning` modules), the eval-mode weights of
    `fast_graph_reasoning`, in `low`: the queries folded with the keys
    (`GraphReasoning.folded_query`), then cast once.

    Returns:
        [(bilinear_t (m, m), key_term (m,), W_r (m, m), b_r (m,)), ...], one tuple per step (a
        list that also keeps the weights stacked as the fused steps' kernel reads them).
    """
    folded = FoldedSteps()
    for step in steps:
        bilinear_t, key_term = step.folded_query()
        folded.append((bilinear_t.to(low), key_term.to(low), step.sim_graph_w.weight.to(low),
                       step.sim_graph_w.bias.to(low)))
    return folded


def fast_graph_reasoning(folded: list[tuple[torch.Tensor, ...]], nodes: torch.Tensor, node_mask: torch.Tensor,
                         has_global: bool) -> torch.Tensor:
    """Eval-only `sgraf.model.reasoning.graph_reasoning` (autocast off, no autograd) in the nodes'
    dtype.

    Per step: the edge logits use the folded `W_q^T W_k` (see `fold_steps`); the edge softmax
    and the aggregation `E N` go through `sgraf.kernels.edges` (the faster of two routes on this
    device); Eq. 8's `ReLU(W_r E N + b_r)` is one matmul with the ReLU applied as it writes. The
    last step updates only the global node (the read-out). On a CUDA device with Triton all the
    steps may instead run in one kernel (`reason`, by its measured route, `step_route`).
    The matmuls and the edge softmax run in the nodes' dtype (float32, or bfloat16 for bf16
    scoring, the softmax accumulating in float32); the result is float32.

    Args:
        folded: `fold_steps` of the model's reasoning steps, in the nodes' dtype.
        nodes: (n_img, n_cap, P, m) similarity nodes, float32 or bfloat16.
        node_mask: (n_cap, P) bool valid nodes.
        has_global: node 0 is the global alignment (the read-out); else valid nodes are averaged.

    Returns:
        (n_img, n_cap, m) float32.
    """
    n_img, n_cap, n_nodes, dim = nodes.shape
    low = nodes.dtype
    # additive key mask (n_cap, P), shared by every image; 0 and -inf are exact in bf16. On the
    # CPU None when every node is valid (captions of one length, as in a bucket); on a GPU always
    # built, since asking would wait for the device (adding 0 is exact), and in a compiled graph,
    # where a question about values would break the graph.
    blocked = None
    if plan.gpu_plan(nodes.device) or torch.compiler.is_compiling() or not bool(node_mask.all()):
        blocked = torch.zeros(node_mask.shape, dtype=low, device=nodes.device).masked_fill_(~node_mask, float("-inf"))
    graphs = nodes.view(n_img * n_cap, n_nodes, dim)                                # (G, P, m)
    route = step_route(nodes.device, low, dim, len(folded))
    if folded and applies(route, n_nodes, has_global, low):                   # all the steps in one kernel
        return reason(folded, graphs, blocked, n_cap, route).view(n_img, n_cap, dim)
    graphs = eager_steps(folded, graphs, blocked, n_img, has_global).float()
    if has_global:
        return graphs[:, 0].reshape(n_img, n_cap, dim)
    weights = node_mask.to(graphs.dtype).view(1, n_cap, n_nodes, 1)
    pooled = (graphs.view(n_img, n_cap, n_nodes, dim) * weights).sum(dim=2) / weights.sum(dim=2)
    return pooled


def step_route(device: torch.device | str, dtype: torch.dtype, dim: int, steps: int) -> str:
    """'eager' or a fused route ('fused' or 'fused RxCxWxS') for `reason` on `device` in
    `dtype`: `SGRAF_STEP_ROUTE` if set, else the choice `measure_step_route` stored for this
    device, else the default. Never measures (it is asked inside the scoring loop)."""
    return ROUTE.peek(_name(dtype, dim, steps), device, fusable(device), dtype in DTYPES)


def measure_step_route(device: torch.device | str, dtype: torch.dtype, dim: int, steps: int) -> str:
    """`step_route`, measured on this device if it has not been (a scorer calls this before
    scoring a large split)."""
    device = torch.device(device)

    def runner(route: str) -> Callable[[], Any]:
        folded, graphs, blocked, n_cap = probe(device, dtype, dim, steps)
        if route == ROUTES[0]:
            return lambda: eager_steps(folded, graphs, blocked, graphs.size(0) // n_cap, True)[:, 0]
        return lambda: reason(folded, graphs, blocked, n_cap, route)

    return ROUTE.choose(_name(dtype, dim, steps), device, fusable(device), dtype in DTYPES, runner, dtype)


def _name(dtype: torch.dtype, dim: int, steps: int) -> str:
    return f"sgr step route|{dtype_key(dtype)}|m={dim}|steps={steps}"


def applies(route: str, n_nodes: int, has_global: bool, dtype: torch.dtype) -> bool:
    """Whether `route` runs the kernel for graphs of `n_nodes` nodes in `dtype` (else the eager
    steps): 16-bit nodes, at most `MAX_NODES`, and a global node to read out."""
    return route.startswith("fused") and has_global and n_nodes <= MAX_NODES and dtype in DTYPES


def eager_steps(folded: list[tuple[torch.Tensor, ...]], graphs: torch.Tensor, blocked: torch.Tensor | None,
                n_img: int, has_global: bool) -> torch.Tensor:
    """The eager route: per step the folded queries, the edge step (`sgraf.kernels.edges`, by its
    route on this device) and `ReLU(W_r E N + b_r)` (the ReLU applied as the matmul writes).

    Args and the tensors' dtype as `reason`'s; `n_img` the images of the block.

    Returns:
        (G, Q, m) in the nodes' dtype: every node after the last step, or with `has_global` the
        global node alone (Q = 1: the last step updates only the read-out).
    """
    route = edges.edge_route(graphs.device, graphs.dtype, graphs.size(2))
    for index, (bilinear_t, key_term, w_r, b_r) in enumerate(folded):
        last = has_global and index == len(folded) - 1
        queries = fast_linear(graphs[:, :1] if last else graphs, bilinear_t, key_term)  # (G, Q, m)
        aggregated = edges.edge_aggregate(queries, graphs, blocked, n_img, route)     # (G, Q, m)
        graphs = fast_linear(aggregated, w_r, b_r, relu=True)                        # (G, Q, m)
    return graphs


def reason(folded: list[tuple[torch.Tensor, ...]], graphs: torch.Tensor, blocked: torch.Tensor | None,
           n_cap: int, route: str) -> torch.Tensor:
    """The fused route: every reasoning step over `graphs`, the global node's last vector.

    Args:
        folded: `fold_steps` (a `FoldedSteps`; a plain list is stacked
            here), in the nodes' dtype.
        graphs: (G, P, m) nodes of G = n_img x n_cap graphs (image-major), contiguous; node 0
            is the global node.
        blocked: (n_cap, P) additive key mask (0 or -inf) in the nodes' dtype, or None.
        route: 'fused' (the first of `TILES`) or 'fused RxCxWxS'.

    Returns:
        (G, m) float32: the global node after the last step.
    """
    import triton

    rows, chunk, warps, stages = ROUTE.tile(route)
    n_graphs, n_nodes, dim = graphs.shape
    if not graphs.is_contiguous() or n_nodes > MAX_NODES:
        raise ValueError(f"reason() takes contiguous graphs of at most {MAX_NODES} nodes")
    nodes_tile = max(2, triton.next_power_of_2(n_nodes))
    rows = max(rows, nodes_tile)
    per_program = rows // nodes_tile
    programs = triton.cdiv(n_graphs, per_program)
    low = graphs.dtype
    stacked = (folded if isinstance(folded, FoldedSteps) else FoldedSteps(folded)).stacked
    bilinear, key_term, weight, bias = (weights.to(low) for weights in stacked)
    dim_tile = max(16, triton.next_power_of_2(dim))           # a tile's width (the nodes' padded)
    scratch = torch.empty(programs * rows, dim_tile, device=graphs.device, dtype=low)
    out = torch.empty(n_graphs, dim, device=graphs.device, dtype=torch.float32)
    exact = low == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _kernel()[(programs,)](
        graphs, graphs if blocked is None else blocked.contiguous(), bilinear, key_term, weight, bias, scratch,
        out, n_graphs, n_cap, n_nodes, STEPS=len(folded), DIM=dim, DIM_TILE=dim_tile, NODES=nodes_tile,
        ROWS=rows, GLOBALS=max(16, per_program), CHUNK=min(chunk, dim_tile), HAS_MASK=blocked is not None,
        PRECISION="ieee" if exact else "tf32",
        # Triton's interpreter (the CPU tests) multiplies bf16 tiles wrongly and truncates casts to
        # bf16: there the tiles are float32 and the rounding is done on the bits
        WIDEN=interpreted, EMULATE=interpreted and low == torch.bfloat16, num_warps=warps, num_stages=stages,
        enable_fp_fusion=FP_FUSION)
    return out


def _kernel() -> Any:
    """The Triton kernel (its module imported at the first use)."""
    from sgraf.kernels.triton_graph_steps import graph_steps_kernel

    return graph_steps_kernel


def probe(device: torch.device, dtype: torch.dtype, dim: int, steps: int, seed: int = 0,
          block: tuple[int, int, int] | None = None) -> tuple[Any, ...]:
    """`reason` inputs drawn on `device`, shaped like a scoring block's graphs (`block`: images,
    captions, nodes; default `PROBE_GRAPHS` on a GPU, a small one elsewhere): (folded, graphs,
    blocked, n_cap), a third of the captions a word shorter (a masked key)."""
    n_img, n_cap, n_nodes = block or (PROBE_GRAPHS if device.type == "cuda" else (3, 4, 6))
    generator = torch.Generator(device).manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * scale

    folded = FoldedSteps(tuple(t.to(dtype) for t in (draw(dim, dim, scale=dim ** -0.5), draw(dim, scale=0.1),
                                                     draw(dim, dim, scale=2 * dim ** -0.5), draw(dim, scale=0.1)))
                         for _ in range(steps))
    graphs = torch.nn.functional.normalize(draw(n_img * n_cap, n_nodes, dim), dim=-1).to(dtype)
    lengths = n_nodes - (torch.arange(n_cap, device=device) % 3 == 0).long()
    blocked = torch.zeros(n_cap, n_nodes, device=device).masked_fill_(
        torch.arange(n_nodes, device=device) >= lengths[:, None], float("-inf")).to(dtype)
    return folded, graphs, blocked, n_cap
