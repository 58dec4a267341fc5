"""The authors' per-caption scoring loop, kept ONLY as a test oracle and a benchmark reference.

Slow and obviously faithful: one caption at a time, repeated against every image, exactly the
order of operations of the official `EncoderSimilarity.forward` (including, in training mode,
SAF's BatchNorm called once per caption). It reads the weights of an `SGRAF` model and shares
none of the vectorised code paths. Also covers the ablation switches, written the same way.

`authors_forward` and `authors_shard_scores` put it together as the authors run it (their
training forward and their evaluation loop): what the benchmarks time as "the authors' code".
Their layers run on PyTorch's own kernels (`sgraf.kernels.cpu.authors_kernels`), as theirs do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from sgraf.kernels.cpu import authors_kernels
from sgraf.model.norms import cosine, l1norm, l2norm


def _visual_global(sa: torch.nn.Module, regions: torch.Tensor) -> torch.Tensor:
    local = sa.embedding_local(regions)
    glob = sa.embedding_global(torch.mean(regions, 1)).unsqueeze(1).repeat(1, local.size(1), 1)
    weights = torch.softmax(sa.embedding_common(local.mul(glob)).squeeze(2), dim=1)
    return l2norm((weights.unsqueeze(2) * regions).sum(dim=1), dim=-1)


def _text_global(sa: torch.nn.Module, words: torch.Tensor) -> torch.Tensor:
    return _visual_global(sa, words)   # same computation; the text side has no BatchNorm layers


def _scan_attention(query: torch.Tensor, context: torch.Tensor, smooth: float) -> torch.Tensor:
    """SCAN attention of `query` (batch, Lq, d) over `context` (batch, Lc, d) -> (batch, Lq, d).

    In the authors' order of operations and memory layouts (the attention transposed into
    contiguous copies twice, the attended context formed as (batch, d, Lq) and read through a
    transposed view), so that timing this loop times theirs.
    """
    attn = torch.bmm(context, query.transpose(1, 2))          # (batch, Lc, Lq)
    attn = F.leaky_relu(attn, 0.1)
    attn = l2norm(attn, 2)
    attn = torch.softmax(attn.transpose(1, 2).contiguous() * smooth, dim=2)   # (batch, Lq, Lc)
    attended = torch.bmm(context.transpose(1, 2), attn.transpose(1, 2).contiguous())  # (batch, d, Lq)
    return l2norm(attended.transpose(1, 2), dim=-1)


def _node(sim: Any, x: torch.Tensor, y: torch.Tensor, layer_name: str) -> torch.Tensor:
    if sim.similarity == "scalar":
        return cosine(x, y).unsqueeze(-1)
    return l2norm(getattr(sim, layer_name)(torch.pow(torch.sub(x, y), 2)), dim=-1)


def _sgr(sim: Any, nodes: torch.Tensor) -> torch.Tensor:
    for step in sim.SGR_module:
        query = step.graph_query_w(nodes)
        key = step.graph_key_w(nodes)
        edges = torch.softmax(torch.bmm(query, key.permute(0, 2, 1)), dim=-1)
        nodes = torch.relu(step.sim_graph_w(torch.bmm(edges, nodes)))
    return nodes[:, 0, :] if sim.use_global else nodes.mean(dim=1)


def _saf(sim: Any, nodes: torch.Tensor) -> torch.Tensor:
    saf = sim.SAF_module
    attn = l1norm(torch.sigmoid(saf.bn(saf.attn_sim_w(nodes).permute(0, 2, 1))), dim=-1)  # (n_img, 1, P)
    return l2norm(torch.matmul(attn, nodes).squeeze(1), dim=-1)


@authors_kernels()
def oracle_similarity(model: torch.nn.Module, img_embs: torch.Tensor, cap_embs: torch.Tensor,
                      lengths: Any) -> dict[str, torch.Tensor]:
    """Per-caption scores {head: (n_img, n_cap)} from embeddings, the authors' way."""
    sim = model.sim_enc
    n_image = img_embs.size(0)
    img_glo = _visual_global(sim.v_global_w, img_embs) if sim.use_global else None
    columns: dict[str, list[torch.Tensor]] = {head: [] for head in model.heads}
    for i in range(cap_embs.size(0)):
        n_word = int(lengths[i])
        cap_i = cap_embs[i, :n_word, :].unsqueeze(0)
        cap_i_expand = cap_i.repeat(n_image, 1, 1)
        nodes = []
        if sim.use_global:
            cap_glo_i = _text_global(sim.t_global_w, cap_i)
            nodes.append(_node(sim, img_glo, cap_glo_i, "sim_tranglo_w").unsqueeze(1))
        if sim.use_local:
            if sim.attention == "t2i":
                context = _scan_attention(cap_i_expand, img_embs, sim.smooth)
                nodes.append(_node(sim, context, cap_i_expand, "sim_tranloc_w"))
            else:
                context = _scan_attention(img_embs, cap_i_expand, sim.smooth)
                nodes.append(_node(sim, context, img_embs, "sim_tranloc_w"))
        sim_emb = torch.cat(nodes, 1)                                 # (n_img, P, m)
        for head in model.heads:
            if head == "sgr":
                columns[head].append(torch.sigmoid(sim.sim_eval_w(_sgr(sim, sim_emb))))
            elif head == "saf":
                layer = sim.saf_eval_w if sim.module == "joint" else sim.sim_eval_w
                columns[head].append(torch.sigmoid(layer(_saf(sim, sim_emb))))
            else:
                per_node = sim_emb if sim.similarity == "scalar" else torch.sigmoid(sim.sim_eval_w(sim_emb))
                columns[head].append(per_node.mean(dim=1))
    return {head: torch.cat(cols, 1) for head, cols in columns.items()}


def _word_states(enc: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """The GRU's outputs (n, L, d or 2d) as the text encoder's word features: the two directions
    averaged for a bidirectional GRU, then l2-normalised if the encoder normalises."""
    if enc.bi_gru:
        half = states.size(2) // 2
        states = (states[:, :, :half] + states[:, :, half:]) / 2
    return l2norm(states, dim=-1) if enc.normalize else states


def oracle_encode_captions(model: torch.nn.Module, captions: torch.Tensor, lengths: Any) -> torch.Tensor:
    """Each caption through the text encoder on its own (no packing), zero-padded to max(lengths)."""
    enc = model.txt_enc
    max_len = int(max(int(n) for n in lengths))
    out = []
    for i in range(captions.size(0)):
        n_word = int(lengths[i])
        states, _ = enc.cap_rnn(enc.dropout(enc.embed(captions[i : i + 1, :n_word])))
        out.append(F.pad(_word_states(enc, states), (0, 0, 0, max_len - n_word)))
    return torch.cat(out, 0)


@authors_kernels()
def oracle_forward(model: torch.nn.Module, images: torch.Tensor, captions: torch.Tensor,
                   lengths: Any) -> dict[str, torch.Tensor]:
    """Per-caption scores {head: (n_img, n_cap)} from raw inputs, in the model's current mode."""
    return oracle_similarity(model, model.img_enc(images), oracle_encode_captions(model, captions, lengths), lengths)


def authors_encode_captions(model: torch.nn.Module, captions: torch.Tensor, lengths: Any) -> torch.Tensor:
    """The text encoder as the authors run it on a batch: PyTorch's packing of the padded batch
    (one copy per time step each way) around the GRU. (n_cap, max(lengths), d), zero-padded."""
    enc = model.txt_enc
    lengths = torch.as_tensor(lengths).cpu()
    packed = pack_padded_sequence(enc.dropout(enc.embed(captions[:, : int(lengths.max())])), lengths,
                                  batch_first=True, enforce_sorted=False)
    states, _ = pad_packed_sequence(enc.cap_rnn(packed)[0], batch_first=True)
    return _word_states(enc, states)


@authors_kernels()
def authors_forward(model: torch.nn.Module, images: torch.Tensor, captions: torch.Tensor,
                    lengths: Any) -> dict[str, torch.Tensor]:
    """The authors' training forward as they run it: both encoders once over the whole batch
    (the GRU on PyTorch's packed sequences), then the per-caption similarity loop against all
    images of the batch. {head: (n_img, n_cap)}, in the model's current mode."""
    return oracle_similarity(model, model.img_enc(images), authors_encode_captions(model, captions, lengths),
                             lengths)


def authors_shard_scores(model: torch.nn.Module, img_embs: torch.Tensor, cap_embs: torch.Tensor, lengths: Any,
                         shard: int = 100) -> torch.Tensor:
    """The authors' evaluation loop (`shard_attn_scores`): the split in shards of `shard` images x
    `shard` captions, each caption of a shard scored against the shard's images one caption at a
    time. (n_img, n_cap) scores of the model's own head (for a joint model, the mean of both)."""
    n_img, n_cap = img_embs.size(0), cap_embs.size(0)
    lengths = torch.as_tensor(lengths)
    sims = img_embs.new_empty(n_img, n_cap)
    for row in range(0, n_img, shard):
        for col in range(0, n_cap, shard):
            heads = oracle_similarity(model, img_embs[row:row + shard], cap_embs[col:col + shard],
                                      lengths[col:col + shard])
            sims[row:row + shard, col:col + shard] = sum(heads.values()) / len(heads)
    return sims
