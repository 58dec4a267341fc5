"""SGR's eval edge step, `softmax_row(Q N^T + mask) N` for every graph of a block, by the
faster of two routes on this device.

Each (image, caption) pair is a graph of a dozen nodes, so the step is hundreds of thousands of
tiny products. The two routes give the same values up to float rounding:

- `layout`: two batched matmuls with the logits laid out (keys, graphs, queries), so that the
  softmax over a dozen keys runs with every graph and query side by side in memory (about 15x
  faster than a softmax over rows of a dozen keys on the CPU).
- `sdpa`: PyTorch's fused attention (`scaled_dot_product_attention`, scale 1): the logits,
  softmax and aggregation in one kernel that keeps the logits on chip, where a GPU would
  otherwise run two batched matmuls of 13 x 13 x 256 (old-generation kernels in the H200's
  profile) and a softmax through memory.

`measure_edge_route(device, dtype, dim)` times both once per device, dtype and node width on a
probe shaped like a scoring block (`sgraf.kernels.tuning`; a scorer calls it before scoring a
large split) and keeps `layout`, the default, unless `sdpa` is more than 20 % faster;
`edge_route` then returns the stored choice without measuring. `SGRAF_EDGE_ROUTE=layout|sdpa`
forces one; a compiled graph (`sgraf.kernels.compiled`) and `plan.emulate_gpu` (launch counting)
take the default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgraf.kernels import plan, tuning

ROUTES = ("layout", "sdpa")          # the first is the default
# The probes: (images, captions, nodes) of a scoring block's graphs, 16 nodes (a global node and
# up to 15 words, a length bucket's padding), two thirds of the captions shorter (masked keys).
# A GPU's is larger (a small one would time its launches, not its kernels).
PROBE_GRAPHS = {"cpu": (16, 128, 16), "gpu": (128, 256, 16)}


def edge_route(device: torch.device | str, dtype: torch.dtype, dim: int) -> str:
    """'layout' or 'sdpa' for `edge_aggregate` on `device` in `dtype` with `dim`-wide nodes:
    `SGRAF_EDGE_ROUTE` if set, else the choice `measure_edge_route` stored for this device, else
    the default. Never measures (it is asked inside the scoring loop, where a probe would wait
    for the device)."""
    if torch.compiler.is_compiling():      # traced once; no environment read inside the graph
        return ROUTES[0]
    forced = _forced()
    if forced:
        return forced
    if _emulated(device):
        return ROUTES[0]
    return tuning.peek(_name(dtype, dim), ROUTES, device=device)


def measure_edge_route(device: torch.device | str, dtype: torch.dtype, dim: int) -> str:
    """`edge_route`, measured on this device if it has not been (`sgraf.kernels.tuning.choose`;
    a scorer calls this before scoring a large split, outside `torchrun`)."""
    forced = _forced()
    if forced:
        return forced
    device = torch.device(device)
    if _emulated(device):
        return ROUTES[0]
    return tuning.choose(_name(dtype, dim), ROUTES, lambda route: _time_route(route, device, dtype, dim),
                         device=device)


def _forced() -> str:
    return tuning.forced_route("SGRAF_EDGE_ROUTE", ROUTES)


def _emulated(device: torch.device | str) -> bool:
    """The GPU plan on CPU tensors (launch counting): the default route, as a fresh device takes."""
    return torch.device(device).type == "cpu" and plan.gpu_plan(device)


def _name(dtype: torch.dtype, dim: int) -> str:
    return f"sgr edge route|{dtype}|m={dim}"


def edge_aggregate(queries: torch.Tensor, graphs: torch.Tensor, blocked: torch.Tensor | None, n_img: int,
                   route: str) -> torch.Tensor:
    """`softmax_row(queries graphs^T + blocked) graphs` for every graph.

    Args:
        queries: (G, Q, m) query nodes of G = n_img x n_cap graphs (image-major).
        graphs: (G, P, m) key (and value) nodes.
        blocked: (n_cap, P) additive key mask (0 or -inf) in the nodes' dtype, shared by every
            image, or None when every key is valid.
        route: `edge_route`'s answer.

    Returns:
        (G, Q, m) in the nodes' dtype (the softmax accumulating in float32 for bf16 input).
    """
    n_graphs, n_nodes, dim = graphs.shape
    n_queries = queries.size(1)
    n_cap = n_graphs // n_img
    if route == "sdpa":
        keys = graphs.view(n_img, n_cap, n_nodes, dim)
        mask = None if blocked is None else blocked.view(1, n_cap, 1, n_nodes)
        out = F.scaled_dot_product_attention(queries.view(n_img, n_cap, n_queries, dim), keys, keys,
                                             attn_mask=mask, scale=1.0)
        # CUDA's attention kernels may return the heads' dimension outermost (strides not
        # those of a contiguous tensor): reshape copies only then
        return out.reshape(n_graphs, n_queries, dim)
    # (G, P, Q) keys x queries, then transposed to (P, G, Q); a matmul writing there directly is
    # slower with MKL (float32) and no faster with oneDNN (bf16)
    logits = torch.bmm(graphs, queries.transpose(1, 2)).permute(1, 0, 2).contiguous()
    if blocked is not None:
        logits.view(n_nodes, n_img, n_cap, n_queries).add_(blocked.t().reshape(n_nodes, 1, n_cap, 1))
    # the softmax accumulates in float32 for bf16 input too; its bf16 output is what the
    # aggregation matmul reads
    edges = logits.softmax(dim=0).permute(1, 2, 0).contiguous()                     # (G, Q, P)
    return torch.bmm(edges, graphs)


def _time_route(route: str, device: torch.device, dtype: torch.dtype, dim: int) -> float:
    n_img, n_cap, n_nodes = PROBE_GRAPHS["gpu" if plan.gpu_plan(device) else "cpu"]
    # drawn on the device in `dtype` (a GPU's probe is two tensors of 134 M values)
    generator = torch.Generator(device).manual_seed(0)
    shape = (n_img * n_cap, n_nodes, dim)
    graphs = F.normalize(torch.randn(shape, generator=generator, device=device, dtype=dtype), dim=-1)
    queries = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    lengths = torch.arange(n_cap) % 3 + n_nodes - 3           # 13, 14 and 15 words
    blocked = torch.zeros(n_cap, n_nodes).masked_fill_(torch.arange(n_nodes) > lengths[:, None], float("-inf"))
    blocked = blocked.to(device, dtype)

    def run() -> None:
        edge_aggregate(queries, graphs, blocked, n_img, route)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return tuning.best_time(run)
