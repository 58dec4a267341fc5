"""Similarity Graph Reasoning, Eq. 6-8.

Each step has its own weights: edges `E = softmax_row(q k^T)` with `q = W_q N`, `k = W_k N`
(Eq. 6), aggregation `E N` (Eq. 7) and `N <- ReLU(W_r E N)` (Eq. 8). The output is the
reasoned global node (or, without a global node, the mean of the reasoned local nodes, as the
paper's Table 3 rows 2-3 describe).
"""

from __future__ import annotations

import torch
from torch import nn


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

    def folded_logits(self, queries: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """Edge logits `q k^T` up to a per-row constant, with one matmul less (eval only).

        `(W_q s + b_q) . (W_k s' + b_k) = s (W_q^T W_k) s'^T + (W_k^T b_q) . s' + terms of s
        alone`; those last terms are constant along a softmax row, so they are dropped.

        Args:
            queries: (G, Q, m) query nodes.
            nodes: (G, P, m) key nodes.

        Returns:
            (G, Q, P) logits with the same row-wise softmax as Eq. 6.
        """
        w_q, b_q = self.graph_query_w.weight, self.graph_query_w.bias
        w_k = self.graph_key_w.weight
        bilinear = w_q.t() @ w_k                                    # (m, m)
        key_bias = nodes @ (w_k.t() @ b_q)                          # (G, P)
        return (queries @ bilinear.to(queries.dtype)) @ nodes.transpose(1, 2) + key_bias.unsqueeze(1)

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
