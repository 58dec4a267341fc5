"""Training mode against the authors' one optimisation step (golden_train.pt), and the
vectorised per-caption SAF BatchNorm against the per-caption oracle on other shapes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from model_helpers import DATA, flat_state, golden_model, random_batch, random_model
from numerics import (AUTHORS, GRADIENT, REORDERED, STEP, adam_noise, approx, assert_close, assert_same_math,
                      conditioned_scale, largest)
from sgraf.config import ModelConfig
from sgraf.kernels import plan
from sgraf.model.loss import ranking_loss
from sgraf.model.oracle import oracle_forward
from sgraf.model.sgraf import SGRAF

pytestmark = pytest.mark.numeric


@pytest.fixture(scope="module")
def golden_train():
    return torch.load(DATA / "golden_train.pt", weights_only=True)


def _train_step(model, optimizer, entry):
    scores = model(entry["images"], entry["captions"], entry["lengths"])
    loss = ranking_loss(scores)
    optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), entry["grad_clip"])
    optimizer.step()
    return scores, loss, norm


def _fed_by_noise(key, noisy):
    """BatchNorm buffers right after a noise-dominated bias: their running mean moves with it."""
    prefix, layer = key.rsplit(".", 1)[0].rsplit(".", 1)
    if layer.isdigit():
        previous = f"{prefix}.{int(layer) - 1}.bias"
    else:
        previous = f"{prefix}.attn_sim_w.bias"
    return "running" in key and previous in noisy


def _assert_state(model, expected, noisy, lr, steps=1):
    state, expected = model.state_dict(), flat_state(expected)
    scale = largest([v for k, v in expected.items() if not k.endswith("num_batches_tracked")])
    for key, value in expected.items():
        if key.endswith("num_batches_tracked"):
            assert int(state[key]) == int(value), key
        elif key in noisy:
            assert (state[key] - value).abs().max() <= adam_noise(lr, steps), key
        elif steps > 1 and _fed_by_noise(key, noisy):
            assert (state[key] - value).abs().max() <= adam_noise(lr), key
        else:
            assert_close(state[key], value, STEP, scale=scale, what=key)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_one_adam_step_matches_the_official_step(golden_train, module):
    entry = golden_train[module]
    model = golden_model(entry, module, state_key="state_dict_before", dropout=0.0).train()
    opt = entry["optimizer"]
    optimizer = torch.optim.Adam(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"])
    scores, loss, norm = _train_step(model, optimizer, entry)
    assert_close(scores, entry["sims"], AUTHORS, what="train scores")
    assert loss.item() == approx(entry["loss"], AUTHORS)
    assert norm.item() == approx(entry["grad_norm"], GRADIENT)
    _assert_state(model, entry["state_dict_after"], set(entry["noise_dominated_grads"]), opt["lr"])
    for key, (_, after) in entry["num_batches_tracked_before_after"].items():
        assert int(model.state_dict()[key]) == after
    # second official step on the same batch
    scores2, loss2, norm2 = _train_step(model, optimizer, entry)
    step2 = entry["step2"]
    assert_close(scores2, step2["sims"], AUTHORS, what="train scores, step 2")
    assert loss2.item() == approx(step2["loss"], AUTHORS)
    assert norm2.item() == approx(step2["grad_norm"], GRADIENT)
    # after two steps the noise-dominated biases (up to 2 x lr apart) also shift the running mean
    # of the BatchNorm that follows them, by at most that much
    _assert_state(model, step2["state_dict_after"], set(entry["noise_dominated_grads"]), opt["lr"], steps=2)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_every_gradient_matches_the_official_gradient(golden_train, module):
    entry = golden_train[module]
    model = golden_model(entry, module, state_key="state_dict_before", dropout=0.0).train()
    loss = ranking_loss(model(entry["images"], entry["captions"], entry["lengths"]))
    loss.backward()
    params = dict(model.named_parameters())
    assert set(entry["grads"]) == set(params)
    scale = largest(entry["grads"])
    for key, grad in entry["grads"].items():
        assert_close(params[key].grad, grad, GRADIENT, scale=scale, what=key)


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_unsorted_batch_gives_the_same_train_scores(golden_train, module):
    entry = golden_train[module]
    model = golden_model(entry, module, state_key="state_dict_before", dropout=0.0).train()
    ids = torch.tensor(entry["ids"])
    lengths = entry["lengths_unsorted"]
    captions = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, caption in enumerate(entry["captions_unsorted"]):
        captions[row, : len(caption)] = torch.as_tensor(caption)
    with torch.no_grad():
        scores = model(entry["images_unsorted"], captions, lengths)
    # the SAF BatchNorm depends only on each caption's own values, so order changes nothing
    assert_close(scores[ids][:, ids], entry["sims"], AUTHORS)


@pytest.mark.parametrize("config", [dict(module="saf"), dict(module="joint"), dict(module="saf", alignments="local"),
                                    dict(module="saf", attention="i2t")])
def test_train_mode_matches_per_caption_oracle_including_running_stats(config):
    lengths = [5, 3, 9, 3, 7, 4, 8]                     # unsorted, mixed, two of length 3
    model = random_model(4, num_regions=6, **config).train()
    oracle = random_model(4, num_regions=6, **config).train()
    images, captions, lengths = random_batch(model, 5, lengths, pad_to=11, seed=5)
    for _ in range(2):                                   # two forwards: the recurrence continues
        ours = model(images, captions, lengths)
        ours = ours if isinstance(ours, dict) else {model.config.module: ours}
        expected = oracle_forward(oracle, images, captions, lengths)
        for head in expected:
            assert_close(ours[head], expected[head], REORDERED, what=head)
    got, want = model.state_dict(), oracle.state_dict()
    for key in want:
        if "num_batches" in key:
            assert torch.equal(got[key], want[key]), key
        elif "running" in key:
            assert_close(got[key], want[key], REORDERED, what=key)
    assert int(got["sim_enc.SAF_module.bn.num_batches_tracked"]) == 2 * len(lengths)
    # gradients too
    loss = sum(ranking_loss(s[:, :5]) for s in ours.values())
    loss_oracle = sum(ranking_loss(s[:, :5]) for s in expected.values())
    loss.backward()
    loss_oracle.backward()
    oracle_grads = {name: p.grad for name, p in oracle.named_parameters() if p.grad is not None}
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(oracle_grads)
    scale = largest(oracle_grads)
    for name, grad in oracle_grads.items():
        assert_close(grads[name], grad, GRADIENT, scale=scale, what=name)
    # the same in float64, where float32's rounding (amplified in this tiny model's GRU gradients:
    # each float32 computation up to some 330 ulps off float64) cannot hide a difference of the math
    grads64 = []
    for forward in (lambda m, *batch: m(*batch), oracle_forward):
        twin = random_model(4, num_regions=6, **config).double().train()
        for _ in range(2):
            out = forward(twin, images.double(), captions, lengths)
        out = out if isinstance(out, dict) else {twin.config.module: out}
        sum(ranking_loss(s[:, :5]) for s in out.values()).backward()
        grads64.append({name: p.grad for name, p in twin.named_parameters() if p.grad is not None})
    assert_same_math(grads64[0], grads64[1], "float64 gradients against the oracle's")


def test_saf_running_stats_with_cumulative_momentum_match_sequential_updates():
    model = random_model(2, module="saf").train()
    oracle = random_model(2, module="saf").train()
    for m in (model, oracle):
        m.sim_enc.SAF_module.bn.momentum = None
    images, captions, lengths = random_batch(model, 3, [4, 6, 3], seed=9)
    model(images, captions, lengths)
    oracle_forward(oracle, images, captions, lengths)
    for key in ("running_mean", "running_var"):
        assert_close(getattr(model.sim_enc.SAF_module.bn, key), getattr(oracle.sim_enc.SAF_module.bn, key), REORDERED,
                     what=key)


def _train_pass(model, batch, chunk, checkpoint):
    """Loss, gradients and buffers of one train-mode forward + backward (dropout seeded)."""
    model.zero_grad(set_to_none=True)
    model.train_chunk, model.train_checkpoint = chunk, checkpoint
    torch.manual_seed(3)
    scores = model(*batch)
    scores = scores if isinstance(scores, dict) else {"score": scores}
    loss = sum(ranking_loss(s) for s in scores.values())
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, {k: v.clone() for k, v in model.state_dict().items() if "running" in k or "num_b" in k}


@pytest.mark.parametrize("config", [dict(module="sgr"), dict(module="saf"), dict(module="joint"),
                                    dict(module="sgr", alignments="local"), dict(module="saf", attention="i2t")])
@pytest.mark.parametrize("keep_bytes", [0, 7 * 2 * 10 * 12 * 4 * 8, 2**40], ids=["recompute", "mixed", "keep"])
def test_chunked_checkpointed_training_equals_one_block(monkeypatch, config, keep_bytes):
    """Chunks, each recomputed in backward (whole, or only its heads when the nodes are light),
    or kept up to a byte budget, give one unchunked block's loss, gradients and buffers."""
    from sgraf.kernels import train_chunks

    monkeypatch.setattr(train_chunks, "TRAIN_KEEP_BYTES", keep_bytes)
    lengths = [5, 3, 9, 3, 7, 4, 8]                     # unsorted, mixed, two of length 3
    batch = random_batch(random_model(4, num_regions=6, **config), 7, lengths, pad_to=11, seed=5)
    reference_model = random_model(4, num_regions=6, dropout=0.3, **config).train()
    loss, grads, buffers = _train_pass(reference_model, batch, chunk=None, checkpoint=False)
    assert len(reference_model.train_chunks(7, batch[2])) == 1
    # the same passes in float64, where only the math can differ (float32's light word nodes and
    # kernels are not taken there): chunks give one block's gradients to float64's rounding
    batch64 = tuple(t.double() if t.is_floating_point() else t for t in batch)
    _, grads64, _ = _train_pass(random_model(4, num_regions=6, dropout=0.3, **config).double().train(), batch64,
                                chunk=None, checkpoint=False)
    scale = conditioned_scale(grads, grads64, largest(grads))
    for chunk in (1, 2, len(lengths)):
        model = random_model(4, num_regions=6, dropout=0.3, **config).train()
        got_loss, got_grads, got_buffers = _train_pass(model, batch, chunk=chunk, checkpoint=True)
        assert got_loss == approx(loss, REORDERED)
        assert set(got_grads) == set(grads)
        for name, grad in grads.items():
            assert_close(got_grads[name], grad, GRADIENT, scale=scale, what=f"chunk {chunk}: {name}")
        _, got64, _ = _train_pass(random_model(4, num_regions=6, dropout=0.3, **config).double().train(), batch64,
                                  chunk=chunk, checkpoint=True)
        assert_same_math(got64, grads64, f"chunk {chunk}, float64")
        for key, value in buffers.items():
            if "num_b" in key:
                assert int(got_buffers[key]) == int(value), key
            else:
                assert_close(got_buffers[key], value, REORDERED, what=key)
    assert grads and (buffers or config.get("alignments") == "local")


CHUNKED_IMAGES, CHUNKED_REGIONS, CHUNKED_LENGTHS = 5, 6, [5, 3, 9, 4, 7]


def _chunked_passes(module: str, counter_type: type):
    """A train-mode forward and backward of a batch cut into 3 chunks, kept and recomputed, each
    under a fresh `counter_type(dim)` (a TorchDispatchMode): yields (checkpoint, counter)."""
    batch = random_batch(random_model(4, num_regions=CHUNKED_REGIONS, module=module), CHUNKED_IMAGES,
                         CHUNKED_LENGTHS, seed=5)
    for checkpoint in (False, True):
        model = random_model(4, num_regions=CHUNKED_REGIONS, module=module).train()
        model.train_chunk, model.train_checkpoint = 2, checkpoint
        assert len(model.train_chunks(CHUNKED_IMAGES, batch[2])) == 3
        counter = counter_type(model.config.embed_size)
        with counter:
            scores = model(*batch)
            ranking_loss(scores if torch.is_tensor(scores) else scores[module]).backward()
        yield checkpoint, counter


@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_a_chunked_batch_forms_the_regions_gram_matrices_once(module):
    """The contexts' norms read each image's (K, K) Gram matrix: a batch cut into chunks forms it
    once, forward and backward, not once per chunk (each chunk kept or recomputed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n_img, n_regions = CHUNKED_IMAGES, CHUNKED_REGIONS

    class GramCount(TorchDispatchMode):
        """Matmuls forming a Gram matrix (regions by regions over the features), and matmuls of
        a Gram matrix's gradient with the regions (its backward)."""

        def __init__(self, dim):
            super().__init__()
            self.dim, self.formed, self.backward = dim, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                dim, shapes, gram = self.dim, [tuple(a.shape) for a in args[:2]], (n_img, n_regions, n_regions)
                if tuple(out.shape) == gram and shapes[0] == (n_img, n_regions, dim):
                    self.formed += 1
                elif gram in shapes and tuple(out.shape) in ((n_img, n_regions, dim), (n_img, dim, n_regions)):
                    self.backward += 1
            return out

    for checkpoint, count in _chunked_passes(module, GramCount):
        assert (count.formed, count.backward) == (1, 2), checkpoint


@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_a_chunked_batch_relates_the_regions_to_every_chunks_words_in_one_matmul(module):
    """`regions @ words^T` of every chunk in one matmul (split by chunk): backward then gives the
    regions' gradient of all chunks in one matmul (and the words' in another), where one per chunk
    gave as many gradients, added into the regions' one at a time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    widths = [4, 7, 9]                      # chunks of 2: lengths (3, 4), (5, 7), (9)
    every_word = 2 * widths[0] + 2 * widths[1] + widths[2]

    class Relevance(TorchDispatchMode):
        """Matmuls with an operand or a product as wide as every chunk's padded words."""

        def __init__(self, dim):
            super().__init__()
            self.forward, self.backward = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                if out.shape[-1] == every_word:
                    self.forward += 1
                elif any(every_word in a.shape for a in args[:2]):
                    self.backward += 1
            return out

    for checkpoint, count in _chunked_passes(module, Relevance):
        assert (count.forward, count.backward) == (1, 2), checkpoint


@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_a_chunked_batch_gathers_the_words_once_and_scatters_their_gradient_once(module):
    """The chunks take their words from one gather in chunk order, split: backward writes the
    words' gradient back once, not once per chunk into a whole zero tensor added to the rest."""
    from torch.utils._python_dispatch import TorchDispatchMode

    scatters = (torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                torch.ops.aten._index_put_impl_.default)

    class WordsIndexing(TorchDispatchMode):
        """Gathers from and scatters into (captions, any width, d) tensors: the words'."""

        def __init__(self, dim):
            super().__init__()
            self.dim, self.gathers, self.scatters = dim, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            shape = tuple(args[0].shape) if args and torch.is_tensor(args[0]) else ()
            # indexed by caption (one 1-D index), not by word (TextSA's (captions, L) mask of the words)
            by_caption = len(args) > 1 and isinstance(args[1], (list, tuple)) and len(args[1]) == 1 \
                and torch.is_tensor(args[1][0]) and args[1][0].dim() == 1
            if len(shape) == 3 and (shape[0], shape[2]) == (len(CHUNKED_LENGTHS), self.dim) and by_caption:
                self.gathers += func is torch.ops.aten.index.Tensor
                self.scatters += func in scatters
            return func(*args, **(kwargs or {}))

    for checkpoint, count in _chunked_passes(module, WordsIndexing):
        assert (count.gathers, count.scatters) == (1, 1), checkpoint


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("grad", [False, True], ids=["matrix", "pairs"])
def test_the_training_reasoning_reads_its_last_query_rows_as_one_matrix(precision, grad):
    """With a global node the last reasoning step queries one row per graph. As a (G, 1, m) slice
    PyTorch's matmul ran that without autograd as G one-row matmuls against the weight expanded
    and copied G times; as a (G, m) matrix it is one matmul, and no tensor holds G weights."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from sgraf.model.reasoning import train_graph_reasoning
    from sgraf.precision import autocast

    model = random_model(4, module="sgr", sim_dim=12)
    n_img, n_cap, n_nodes, dim = 6, 5, 7, 12
    nodes = torch.randn(n_img, n_cap, n_nodes, dim, requires_grad=grad)
    node_mask = torch.ones(n_cap, n_nodes, dtype=torch.bool)
    node_mask[1, 4:] = False

    class Largest(TorchDispatchMode):
        """The most elements of any tensor an operation makes, and the batched matmuls of an
        expanded operand (one matrix repeated over the batch)."""

        def __init__(self):
            super().__init__()
            self.largest, self.expanded_bmms = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if torch.is_tensor(tensor):
                    self.largest = max(self.largest, tensor.numel())
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
                operands = args[1:3] if func is torch.ops.aten.baddbmm.default else args[:2]
                self.expanded_bmms += any(a.size(0) > 1 and a.stride(0) == 0 for a in operands)
            return out

    def run():
        with torch.set_grad_enabled(grad), autocast(precision, "cpu"):
            pooled = train_graph_reasoning(model.sim_enc.SGR_module, nodes, node_mask, has_global=True)
            if grad:
                pooled.float().sum().backward()
        return pooled

    run()                   # the CPU matmul routes' probes (large tensors of their own) first
    counter = Largest()
    with counter:
        pooled = run()
    graphs = n_img * n_cap
    assert pooled.shape == (n_img, n_cap, dim)
    assert counter.expanded_bmms == 0
    assert counter.largest < graphs * dim * dim, counter.largest     # no weight copied per graph
    # with and without autograd the same read-out
    with torch.no_grad(), autocast(precision, "cpu"):
        again = train_graph_reasoning(model.sim_enc.SGR_module, nodes.detach(), node_mask, has_global=True)
    assert torch.equal(pooled.detach(), again)


def test_train_chunks_follow_the_memory_budget_and_sort_by_length(monkeypatch):
    from sgraf.kernels import train_chunks

    model = random_model(2, module="saf").train()
    lengths = torch.tensor([4, 9, 2, 7, 3])
    # a budget of 10 padded words per chunk (3 images, d=16, float32)
    monkeypatch.setattr(train_chunks, "TRAIN_CHUNK_BYTES", 4 * 3 * 16 * 10)
    chunks = [c.tolist() for c in model.train_chunks(3, lengths)]
    # sorted lengths 2, 3, 4, 7, 9: (2, 3) pads to 2 x 3 = 6 words; adding 4 would be 3 x 4 = 12 > 10
    assert chunks == [[2, 4], [0], [3], [1]]
    model.train_chunk = 2
    assert [c.tolist() for c in model.train_chunks(3, lengths)] == [[2, 4], [0, 3], [1]]
    model.train_chunk = 0
    with pytest.raises(ValueError, match="train_chunk"):
        model.train_chunks(3, lengths)


def test_train_chunks_on_a_gpu_take_a_number_of_pairs_within_a_share_of_its_free_memory(monkeypatch):
    from sgraf.kernels import train_chunks

    embed, cpu = 16, torch.device("cpu")
    pairs = train_chunks.TRAIN_GPU_CHUNK_PAIRS * 4 * embed                    # bytes of its float32 block
    assert train_chunks.chunk_bytes(cpu, embed) == train_chunks.TRAIN_CHUNK_BYTES
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * 2**30, 80 * 2**30))
    assert train_chunks.chunk_bytes(torch.device("cuda"), embed) == pairs
    # a share however little is free (the CPU's budget could be more than the device has left)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    assert train_chunks.chunk_bytes(torch.device("cuda"), embed) == int(2**20 * train_chunks.TRAIN_GPU_MEMORY_SHARE)
    # the GPU plan emulated on the CPU (sgraf.kernels.plan) cuts the same way
    with plan.emulate_gpu(40 * 2**30):
        assert train_chunks.chunk_bytes(cpu, embed) == pairs
        assert train_chunks.keep_bytes(cpu) == int(40 * 2**30 * train_chunks.TRAIN_GPU_KEEP_SHARE)
    with plan.emulate_gpu(2**20):
        assert train_chunks.chunk_bytes(cpu, embed) == int(2**20 * train_chunks.TRAIN_GPU_MEMORY_SHARE)
    assert train_chunks.keep_bytes(cpu) == train_chunks.TRAIN_KEEP_BYTES
    # at the paper's size a Flickr30K-like batch of 128 takes a few chunks (3 on the H200 measured)
    # (the paper's sizes / 16: the cuts do not depend on the sizes)
    torch.manual_seed(1)
    paper = SGRAF(ModelConfig(vocab_size=100, module="sgr", img_dim=128, word_dim=18, embed_size=64, sim_dim=16))
    words = torch.distributions.Gamma(torch.tensor(5.0), torch.tensor(5.0 / 12.0)).sample((128,))
    lengths = (words.round().clamp(1, 80) + 2).long()   # Flickr30K-like: mean about 14 tokens
    with plan.emulate_gpu(plan.EMULATED_FREE_BYTES // 16):
        assert 2 <= len(paper.train_chunks(128, lengths)) <= 4


@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_authors_forward_computes_the_oracle_scores(module):
    """The benchmarks' stand-in for the authors' training forward (PyTorch's packing around the
    GRU, the per-caption loop in their memory layouts) scores what the per-caption oracle does."""
    from sgraf.model.oracle import authors_forward

    torch.manual_seed(0)
    model = SGRAF(ModelConfig(vocab_size=30, img_dim=12, word_dim=8, embed_size=16, sim_dim=8, num_regions=5,
                              module=module, dropout=0.0)).train()
    images = torch.randn(4, 5, 12)
    lengths = torch.tensor([3, 6, 2, 5])
    captions = torch.randint(1, 30, (4, 7))
    oracle = copy.deepcopy(model)
    got = authors_forward(model, images, captions, lengths)[module]
    expected = oracle_forward(oracle, images, captions, lengths)[module]
    assert got.shape == (4, 4)
    assert_close(got, expected, REORDERED)


def test_the_text_self_attention_skips_the_padding_with_the_same_values_and_random_numbers():
    """On the CPU plan TextSA's local layer runs over the words only (`TextSelfAttention.forward`),
    under the GPU plan over the whole padded block: the same global vectors and gradients up to
    the summation order, the same dropout masks (the same random numbers drawn), and the padded
    block's layer never sees the padding."""
    from sgraf.model.encoders import TextSelfAttention

    torch.manual_seed(0)
    layer = TextSelfAttention(16, dropout=0.4).train()
    lengths = torch.tensor([5, 2, 7, 3])
    mask = torch.arange(7) < lengths.unsqueeze(1)
    words = torch.randn(4, 7, 16) * mask.unsqueeze(2)
    rows = []
    original = layer.embedding_local[0].forward
    layer.embedding_local[0].forward = lambda x: rows.append(x.shape[:-1]) or original(x)
    results = []
    for gpu in (False, True):
        torch.manual_seed(1)                       # the dropouts' random numbers
        inputs = words.clone().requires_grad_()
        with plan.emulate_gpu() if gpu else contextlib.nullcontext():
            out = layer(inputs, mask)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        results.append((out.detach(), inputs.grad, [p.grad.clone() for p in layer.parameters()]))
        layer.zero_grad()
    assert rows == [torch.Size([17]), torch.Size([4, 7])]          # 17 words, then the padded block
    (packed, packed_grad, packed_params), (whole, whole_grad, whole_params) = results
    assert_close(packed, whole, REORDERED, what="global vectors")
    assert_close(packed_grad, whole_grad, REORDERED, scale=largest(whole_grad), what="words' gradient")
    for a, b in zip(packed_params, whole_params):
        assert_close(a, b, REORDERED, scale=largest(whole_params), what="parameters' gradient")
    torch.manual_seed(1)
    eval_free = layer.eval()(words, mask)           # no dropout: a different vector, so the masks mattered
    assert not torch.allclose(eval_free, packed)
