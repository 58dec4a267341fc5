"""Similarity Graph Reasoning, Eq. 6-8.

Each step has its own weights: edges `E = softmax_row(q k^T)` with `q = W_q N`, `k = W_k N`
(Eq. 6), aggregation `E N` (Eq. 7) and `N <- ReLU(W_r E N)` (Eq. 8). The output is the
reasoned global node (or, without a global node, the mean of the reasoned local nodes, as the
paper's Table 3 rows 2-3 describe).

`graph_reasoning` is that math, `train_graph_reasoning` the same with the queries folded into the
keys (one matmul less per step, every parameter's gradient kept). The eval fast path's steps,
with those folded weights cast once (`fold_steps`) and a fused kernel on a GPU, are
`sgraf.kernels.graph_steps.fast_graph_reasoning`.
"""

from __future__ import annotations

import torch
from torch import nn

from sgraf.kernels.cpu import linear, train_linear


class GraphReasoning(nn.Module):
    """One reasoning step (Eq. 6-8) over the nodes of every pair of a block."""

    def __init__(self, sim_dim: int) -> None:
        super().__init__()
        self.graph_query_w = nn.Linear(sim_dim, sim_dim)
        self.graph_key_w = nn.Linear(sim_dim, sim_dim)
        self.sim_graph_w = nn.Linear(sim_dim, sim_dim)

    def forward(self, nodes: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """(G, P, m) nodes of G graphs, (G or 1, 1, P) bool valid keys -> (G, P, m)."""
        edges = self.graph_query_w(nodes) @ self.graph_key_w(nodes).transpose(1, 2)   # (G, P, P)
        edges = edges.masked_fill(~key_mask, float("-inf")).softmax(dim=2)
        return torch.relu(self.sim_graph_w(edges @ nodes))

    def folded_query(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The query layer folded with the key layer: `(W_k^T W_q, W_k^T b_q)`.

        `(W_q s + b_q) . (W_k s' + b_k) = [s (W_q^T W_k) + W_k^T b_q] . s' + terms of s alone`:
        `F.linear(s, *folded_query())` is a query whose dot products with the raw nodes `s'`
        give Eq. 6's logits up to a per-row constant (the same row-wise softmax), one node-wise
        matmul instead of two. Differentiable.

        Returns:
            (m, m) weight and (m,) bias.
        """
        w_k = self.graph_key_w.weight
        return w_k.t() @ self.graph_query_w.weight, w_k.t() @ self.graph_query_w.bias

    def folded_logits(self, queries: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """Edge logits `q k^T` up to a per-row constant, with one matmul less (eval only).

        Args:
            queries: (G, Q, m) query nodes.
            nodes: (G, P, m) key nodes.

        Returns:
            (G, Q, P) logits with the same row-wise softmax as Eq. 6 (see `folded_query`).
        """
        weight, bias = self.folded_query()
        return linear(queries, weight.to(queries.dtype), bias.to(queries.dtype)) @ nodes.transpose(1, 2)

    def fast(self, nodes: torch.Tensor, blocked: torch.Tensor, global_only: bool) -> torch.Tensor:
        """Eval-mode step: folded logits; with `global_only`, only node 0 is updated.

        Args:
            nodes: (G, P, m).
            blocked: (G, 1, P) bool, True for padded keys.

        Returns (G, P, m), or (G, 1, m) with `global_only`.
        """
        queries = nodes[:, :1] if global_only else nodes
        edges = self.folded_logits(queries, nodes).masked_fill_(blocked, float("-inf")).softmax(dim=2)
        return torch.relu_(self.sim_graph_w(edges @ nodes))


def graph_reasoning(steps: nn.ModuleList, nodes: torch.Tensor, node_mask: torch.Tensor,
                    has_global: bool, fast: bool = False) -> torch.Tensor:
    """Run the reasoning steps and read out one vector per pair.

    Args:
        steps: the per-step `GraphReasoning` modules.
        nodes: (n_img, n_cap, P, m) similarity nodes.
        node_mask: (n_cap, P) bool valid nodes.
        has_global: node 0 is the global alignment (the read-out); otherwise the valid nodes
            are averaged after reasoning.
        fast: eval-only shortcuts (folded `W_q^T W_k`, last step on the global node only);
            same values up to float rounding.

    Returns:
        (n_img, n_cap, m).
    """
    n_img, n_cap, n_nodes, dim = nodes.shape
    graphs = nodes.reshape(n_img * n_cap, n_nodes, dim)
    key_mask = node_mask.unsqueeze(0).expand(n_img, n_cap, n_nodes).reshape(n_img * n_cap, 1, n_nodes)
    blocked = ~key_mask
    for index, step in enumerate(steps):
        if fast:
            graphs = step.fast(graphs, blocked, global_only=has_global and index == len(steps) - 1)
        else:
            graphs = step(graphs, key_mask)
    if has_global:
        return graphs[:, 0].view(n_img, n_cap, dim)
    weights = key_mask.transpose(1, 2).to(graphs.dtype)                # (G, P, 1)
    pooled = (graphs * weights).sum(dim=1) / weights.sum(dim=1)
    return pooled.view(n_img, n_cap, dim)


def train_graph_reasoning(steps: nn.ModuleList, nodes: torch.Tensor, node_mask: torch.Tensor,
                          has_global: bool) -> torch.Tensor:
    """Train-mode `graph_reasoning` without the work that cannot reach the output.

    Eq. 6's logits are expanded around the folded `W_q^T W_k`, with autograd through the fold:
    `q k^T = s (W_q^T W_k) s'^T + (W_k^T b_q) . s' + [s . (W_q^T b_k) + b_q . b_k]`, where the
    bracket is one number per query row. That is one node-wise matmul per step instead of two,
    and every parameter, `b_k` included, gets the gradient of the authors' logits. With a global
    node, the last step updates only node 0 (the read-out): one query row and one `W_r` row.

    Args:
        steps: the per-step `GraphReasoning` modules.
        nodes: (n_img, n_cap, P, m) similarity nodes.
        node_mask: (n_cap, P) bool valid nodes.
        has_global: node 0 is the global alignment; otherwise the valid nodes are averaged.

    Returns:
        (n_img, n_cap, m).
    """
    n_img, n_cap, n_nodes, dim = nodes.shape
    # additive key mask, broadcast over images: (1, n_cap, 1, P)
    blocked = torch.zeros(node_mask.shape, dtype=nodes.dtype, device=nodes.device)
    blocked = blocked.masked_fill(~node_mask, float("-inf")).view(1, n_cap, 1, n_nodes)
    graphs = nodes.reshape(n_img * n_cap, n_nodes, dim)                             # (G, P, m)
    for index, step in enumerate(steps):
        last = has_global and index == len(steps) - 1
        w_q, b_q, b_k = step.graph_query_w.weight, step.graph_query_w.bias, step.graph_key_w.bias
        sources = graphs[:, :1] if last else graphs                                # (G, Q, m)
        queries = train_linear(sources, *step.folded_query())                     # (G, Q, m)
        # folded into one matrix-vector product as `linear` folds its input (the last step's
        # (G, 1, m) slice would otherwise take the vector expanded over the graphs)
        row_terms = (sources.reshape(-1, dim) @ (w_q.t() @ b_k)).view(sources.shape[:-1]) + b_q @ b_k  # (G, Q)
        logits = torch.baddbmm(row_terms.unsqueeze(2), queries, graphs.transpose(1, 2))  # (G, Q, P)
        edges = (logits.view(n_img, n_cap, -1, n_nodes) + blocked.to(logits.dtype)).softmax(dim=3)
        aggregated = edges.view(n_img * n_cap, -1, n_nodes) @ graphs
        graphs = torch.relu(train_linear(aggregated, step.sim_graph_w.weight, step.sim_graph_w.bias))
    if has_global:
        return graphs[:, 0].reshape(n_img, n_cap, dim)
    weights = node_mask.to(graphs.dtype).view(1, n_cap, n_nodes, 1)
    return (graphs.view(n_img, n_cap, n_nodes, dim) * weights).sum(dim=2) / weights.sum(dim=2)
