"""On a CUDA device (skipped elsewhere): the same numbers as the CPU's float32 path.

These run only where `torch.cuda.is_available()`; CI machines have no GPU, so there they are
reported as skipped with the reason.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from model_helpers import DATA, golden_model, random_batch, random_model
from numerics import GRADIENT, assert_close, largest
from sgraf import torch_compat
from sgraf.model.loss import ranking_loss
from sgraf.precision import autocast

pytestmark = [pytest.mark.numeric,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")]


def needs_triton() -> None:
    if not torch_compat.triton_usable():
        pytest.skip(f"needs Triton {'.'.join(map(str, torch_compat.TRITON_MIN))} or later")


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_gpu_scores_equal_the_cpu_float32_path_on_the_golden_data(module):
    entry = torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)[module]
    model = golden_model(entry, module)
    cpu = model.score(entry["images"], entry["captions"], entry["lengths"])
    gpu = model.cuda().score(entry["images"].cuda(), entry["captions"].cuda(), entry["lengths"])
    assert gpu.device.type == "cuda"
    assert (gpu.cpu() - cpu).abs().max() <= 1e-5
    assert_close(gpu, entry["sims"], 16)


@pytest.mark.parametrize("route", ["layout", "sdpa"])
def test_each_edge_route_gives_the_cpu_scores_on_the_device(monkeypatch, route):
    """SGR's edge step through either route (`sgraf.kernels.edges`; PyTorch picks the fused
    attention kernel on the device) scores the golden data as the CPU's float32 path does, and
    its bf16 scores stay within bf16 rounding of them."""
    monkeypatch.setenv("SGRAF_EDGE_ROUTE", route)
    entry = torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)["SGR"]
    model = golden_model(entry, "SGR")
    cpu = model.score(entry["images"], entry["captions"], entry["lengths"])
    model = model.cuda()
    images, captions = entry["images"].cuda(), entry["captions"].cuda()
    gpu = model.score(images, captions, entry["lengths"])
    assert (gpu.cpu() - cpu).abs().max() <= 1e-5
    with autocast("bf16", "cuda"):
        bf16 = model.score(images, captions, entry["lengths"])
    assert (bf16.cpu() - cpu).abs().max() <= 2**-10      # 1.6e-4 on the CPU


def test_the_edge_route_is_measured_on_the_device_and_stored(tmp_path, monkeypatch):
    from sgraf.kernels import edges, tuning

    monkeypatch.setenv("SGRAF_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SGRAF_EDGE_ROUTE", raising=False)
    tuning.forget()
    try:
        chosen = edges.measure_edge_route("cuda", torch.bfloat16, 256)
        assert chosen in edges.ROUTES and edges.edge_route("cuda", torch.bfloat16, 256) == chosen
        assert f"{torch.cuda.get_device_name()}" in (tmp_path / "tuning.json").read_text()
    finally:
        tuning.forget()


def test_the_fused_reasoning_steps_give_the_eager_steps_on_the_device():
    """`sgraf.kernels.graph_steps`' Triton kernel at the paper's sizes (64 images x 256 captions,
    graphs of 14 nodes, 3 steps of 256-wide nodes), every tile, in bf16 (the only dtype it is
    routed; float32 compiles for minutes): no further from float64 than the eager steps."""
    dtype = torch.bfloat16
    needs_triton()
    from sgraf.kernels import graph_steps

    folded, graphs, blocked, n_cap = graph_steps.probe(torch.device("cuda"), dtype, 256, 3)
    n_img = graphs.size(0) // n_cap
    eager = graph_steps.eager_steps(folded, graphs, blocked, n_img, True).double()[:, 0]
    exact = graph_steps.eager_steps([tuple(t.double() for t in step) for step in folded], graphs.double(),
                                    blocked.double(), n_img, True)[:, 0]
    largest_value = exact.abs().max().item()
    for route in graph_steps.MEASURED[1:]:
        fused = graph_steps.reason(folded, graphs, blocked, n_cap, route).double()
        assert torch.isfinite(fused).all(), route
        eager_error = (eager - exact).abs().max().item()
        assert (fused - exact).abs().max().item() <= eager_error + 2**-8 * largest_value, route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_layers_relu_in_the_matmul_epilogue_gives_the_separate_relu_on_the_device(dtype):
    """`fast_linear(relu=True)` on CUDA (`torch._addmm_activation`, the ReLU in cuBLASLt's
    epilogue) against the matmul and a ReLU after it, on nodes shaped like SGR's."""
    from sgraf.kernels.cpu import fast_linear

    generator = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(4096, 14, 256, device="cuda", generator=generator).to(dtype)
    weight = (torch.randn(256, 256, device="cuda", generator=generator) / 16).to(dtype)
    bias = torch.randn(256, device="cuda", generator=generator).to(dtype)
    fused = fast_linear(x, weight, bias, relu=True)
    separate = torch.relu(torch.nn.functional.linear(x, weight, bias))
    scale = separate.abs().max().item()
    assert fused.shape == separate.shape and fused.dtype == dtype
    assert (fused.float() - separate.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 2**-8) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_word_nodes_give_the_eager_route_on_the_device(dtype):
    """`sgraf.kernels.words`' Triton kernel at the paper's sizes (a block of 64 images x 256
    captions of 13 words): every node written, and no further from float64 than the eager route
    (float32: the same values up to the accumulation order)."""
    needs_triton()
    from sgraf.kernels import words

    attn, regions, words_, weight, bias, out = words.probe(torch.device("cuda"), dtype, 1024, 256)
    eager = torch.full_like(out, float("nan"))
    words.word_nodes(attn, regions, words_, weight, bias, eager, "eager")
    out.fill_(float("nan"))
    words.word_nodes(attn, regions, words_, weight, bias, out, "fused")
    assert torch.isfinite(out).all()
    contexts = attn.double().transpose(1, 2) @ regions.double()
    local = (contexts - words_.double()).square() @ weight.double().t() + bias.double()
    exact = (local / (local.norm(dim=-1, keepdim=True) + words.EPS)).view(out.shape)
    largest_node = exact.abs().max().item()
    if dtype == torch.float32:
        assert (out - eager).abs().max().item() <= 1e-5 * largest_node
    else:
        eager_error = (eager.double() - exact).abs().max().item()
        assert (out.double() - exact).abs().max().item() <= eager_error + 2**-8 * largest_node


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_global_nodes_give_the_eager_route_on_the_device(dtype):
    """The word nodes' kernel with the attention left out (`words.global_nodes`), every tile, on
    64 images x 256 captions at the paper's sizes: no further from float64 than the eager route
    (float32: the same values up to the accumulation order)."""
    needs_triton()
    from sgraf.kernels import words

    generator = torch.Generator("cuda").manual_seed(0)
    img_glo, cap_glo = (torch.randn(n, 1024, generator=generator, device="cuda") * 0.05 for n in (64, 256))
    weight = (torch.randn(256, 1024, generator=generator, device="cuda") / 32).to(dtype)
    bias = (torch.randn(256, generator=generator, device="cuda") * 0.01).to(dtype)
    eager = words.global_nodes(img_glo, cap_glo, weight, bias, "eager")
    local = (img_glo.double()[:, None] - cap_glo.double()[None]).square() @ weight.double().t() + bias.double()
    exact = local / (local.norm(dim=-1, keepdim=True) + words.EPS)
    largest_node = exact.abs().max().item()
    for route in words.MEASURED[1:]:
        fused = words.global_nodes(img_glo, cap_glo, weight, bias, route)
        assert fused.shape == eager.shape and torch.isfinite(fused).all(), route
        if dtype == torch.float32:
            assert (fused - eager).abs().max().item() <= 1e-5 * largest_node, route
        else:
            eager_error = (eager.double() - exact).abs().max().item()
            assert (fused.double() - exact).abs().max().item() <= eager_error + 2**-8 * largest_node, route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_attention_gives_the_eager_route_on_the_device(dtype):
    """`sgraf.kernels.attention`'s Triton kernel with every tile, on a block of 64 images x 256
    captions of 13 words: after the load it works in float32 as the eager route does, so the two
    agree to the summation order."""
    needs_triton()
    from sgraf.kernels import attention

    relevance, gram, n_words = attention.probe(torch.device("cuda"), dtype)
    eager = attention.scaled_attention(relevance.clone(), gram, n_words, 9.0, "eager")
    for route in attention.MEASURED[1:]:
        fused = attention.scaled_attention(relevance.clone(), gram, n_words, 9.0, route)
        assert torch.isfinite(fused).all(), route
        assert (fused - eager).abs().max().item() <= 1e-5 * eager.abs().max().item(), route


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_filtration_gives_the_eager_route_on_the_device(dtype):
    """`sgraf.kernels.filtration`'s Triton kernel with every tile, on a block of 64 images x 256
    captions of 14 nodes of 256, and on pairs of 33 nodes (padded to 64: fewer pairs per program,
    more warps; the tiles come down to two launches there): after the load it works in float32 as
    the eager route does."""
    needs_triton()
    from sgraf.kernels import filtration

    for block, routes in ((None, filtration.MEASURED[1:]), ((16, 64, 33), ("fused", "fused 8x4x1"))):
        inputs = filtration.probe(torch.device("cuda"), dtype, 256, block=block)
        eager = filtration.filtered(*inputs, route="eager")
        for route in routes:
            fused = filtration.filtered(*inputs, route=route)
            assert fused.shape == eager.shape and torch.isfinite(fused).all(), (block, route)
            assert (fused - eager).abs().max().item() <= 1e-5 * eager.abs().max().item(), (block, route)


@pytest.mark.parametrize("variable, module", [("SGRAF_WORD_ROUTE", "SGR"), ("SGRAF_WORD_ROUTE", "SAF"),
                                              ("SGRAF_STEP_ROUTE", "SGR"), ("SGRAF_ATTENTION_ROUTE", "SGR"),
                                              ("SGRAF_ATTENTION_ROUTE", "SAF"), ("SGRAF_FILTER_ROUTE", "SAF")])
def test_each_fused_route_gives_the_cpu_scores_on_the_device(monkeypatch, variable, module):
    """The word nodes' kernel and the attention's (both modules), SGR's reasoning steps' kernel
    (bf16 only; fp32 takes the eager steps) and SAF's filtration's against the eager CPU scores
    of the golden data."""
    needs_triton()
    entry = torch.load(DATA / "golden_small_perturbed.pt", weights_only=True)[module]
    model = golden_model(entry, module)
    monkeypatch.setenv(variable, "eager")
    cpu = model.score(entry["images"], entry["captions"], entry["lengths"])
    monkeypatch.setenv(variable, "fused")
    model = model.cuda()
    images, captions = entry["images"].cuda(), entry["captions"].cuda()
    assert (model.score(images, captions, entry["lengths"]).cpu() - cpu).abs().max() <= 1e-5
    with autocast("bf16", "cuda"):
        bf16 = model.score(images, captions, entry["lengths"])
    assert (bf16.cpu() - cpu).abs().max() <= 2**-10


@pytest.mark.parametrize("kernel", ["words", "graph_steps", "attention", "filtration"])
def test_each_fused_route_is_measured_on_the_device_and_stored(tmp_path, monkeypatch, kernel):
    """The probe of each Triton kernel at the paper's sizes, in bf16: every tile builds, runs and
    gives the eager route's values within `fused_routes.AGREEMENT` (none timed as never
    finishing), and the choice is stored and read back without measuring."""
    needs_triton()
    from sgraf.kernels import attention, filtration, graph_steps, tuning, words

    module, variable, measure, peek, name = {
        "words": (words, "SGRAF_WORD_ROUTE", words.measure_word_route, words.word_route, "word nodes route"),
        "graph_steps": (graph_steps, "SGRAF_STEP_ROUTE", graph_steps.measure_step_route, graph_steps.step_route,
                        "sgr step route"),
        "attention": (attention, "SGRAF_ATTENTION_ROUTE", lambda *args: attention.measure_attention_route(*args[:2]),
                      lambda *args: attention.attention_route(*args[:2]), "attention route"),
        "filtration": (filtration, "SGRAF_FILTER_ROUTE", lambda *args: filtration.measure_filter_route(*args[:3]),
                       lambda *args: filtration.filter_route(*args[:3]), "saf filter route")}[kernel]
    sizes = (1024, 256) if kernel == "words" else (256, 3)
    monkeypatch.setenv("SGRAF_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(variable, raising=False)
    tuning.forget()
    try:
        chosen = measure("cuda", torch.bfloat16, *sizes)
        assert chosen in module.MEASURED and peek("cuda", torch.bfloat16, *sizes) == chosen
        stored = (tmp_path / "tuning.json").read_text()
        assert name in stored and "Infinity" not in stored   # every tile built and ran
    finally:
        tuning.forget()


@pytest.mark.parametrize("tf32", [False, True])
def test_the_fused_word_nodes_float32_probe_with_and_without_tf32(tmp_path, monkeypatch, tf32):
    """The word nodes' kernel in float32 (its products exact, or in TF32 under `--tf32`, the one
    float32 product no CPU test runs): every tile builds and agrees with the eager route within
    `fused_routes.agreement`, and the choice is stored under its own name."""
    needs_triton()
    from sgraf.kernels import tuning, words
    from sgraf.precision import tf32 as allow_tf32

    monkeypatch.setenv("SGRAF_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SGRAF_WORD_ROUTE", raising=False)
    tuning.forget()
    try:
        with allow_tf32(tf32):
            chosen = words.measure_word_route("cuda", torch.float32, 1024, 256)
        assert chosen in words.MEASURED
        stored = (tmp_path / "tuning.json").read_text()
        assert ("torch.float32|tf32" in stored) == tf32 and "Infinity" not in stored
    finally:
        tuning.forget()


@pytest.mark.parametrize("module", ["SGR", "SAF"])
def test_gpu_gradients_equal_the_authors_within_float32_noise(module):
    entry = torch.load(DATA / "golden_train.pt", weights_only=True)[module]
    model = golden_model(entry, module, state_key="state_dict_before", dropout=0.0).cuda().train()
    ranking_loss(model(entry["images"].cuda(), entry["captions"].cuda(), entry["lengths"])).backward()
    scale = largest(entry["grads"])
    for name, param in model.named_parameters():
        assert_close(param.grad, entry["grads"][name], GRADIENT, scale=scale, what=name)


def test_bf16_keeps_the_fp32_top_1_outside_near_ties():
    """A top-1 change counts as a near-tie when the fp32 scores of the two candidates differ by
    less than twice the largest bf16 error measured on other data (so the bound is not taken
    from the matrix it judges)."""
    model = random_model(5, module="sgr", num_regions=36, img_dim=64, embed_size=128, sim_dim=64).cuda()

    def both(seed):
        lengths = torch.randint(3, 20, (256,), generator=torch.Generator().manual_seed(seed)).tolist()
        images, captions, lengths = random_batch(model, 64, lengths, seed=seed)
        images, captions = images.cuda(), captions.cuda()
        fp32 = model.score(images, captions, lengths)
        with autocast("bf16", "cuda"):
            return fp32, model.score(images, captions, lengths)

    fp32, bf16 = both(2)
    tie = 2 * float((bf16 - fp32).abs().max())
    fp32, bf16 = both(1)
    for dim in (0, 1):
        changed = (fp32.argmax(dim) != bf16.argmax(dim)).nonzero().flatten()
        best = fp32.max(dim).values
        chosen = fp32.gather(dim, bf16.argmax(dim).unsqueeze(dim)).squeeze(dim)
        assert ((best - chosen)[changed] < tie).all()


def test_the_block_loop_never_waits_for_the_device(monkeypatch):
    """Inside the scorer's (image block x caption block) loop nothing synchronises with the GPU:
    the buckets' lengths stay on the CPU, the scores stay on the device (one copy at the end)."""
    from sgraf.model import blocks

    model = random_model(6, module="sgr", num_regions=36, img_dim=64, embed_size=128, sim_dim=64).cuda()
    lengths = torch.randint(3, 20, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    images, captions, lengths = random_batch(model, 40, lengths, seed=4)
    encoded = blocks.encode(model, images.cuda(), captions.cuda(), torch.tensor(lengths), 128, "fp32")
    assert all(bucket.lengths.device.type == "cpu" for bucket in encoded.buckets)
    expected = blocks.score_encoded([model], [encoded], image_block=8)   # also fills the cached constants
    real_block = blocks._score_block

    def strict_block(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_block(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(blocks, "_score_block", strict_block)
    assert torch.equal(blocks.score_encoded([model], [encoded], image_block=8), expected)


@pytest.mark.parametrize("hardest", [False, True], ids=["summed", "hardest-pairs"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_training_step_never_waits_for_the_device(precision, hardest):
    """Under the GPU plan the step reads nothing back (fused Adam skips a non-finite update on the
    device): no synchronisation from the batch's copy to the optimiser's update. The CPU suite
    counts the same reads with `sgraf.kernels.launches` (tests/test_launches.py)."""
    from sgraf.training.config import preset
    from sgraf.training.step import build_optimizer, train_step

    model = random_model(7, module="sgr", num_regions=36, img_dim=64, embed_size=128, sim_dim=64).cuda().train()
    lengths = torch.randint(3, 20, (32,), generator=torch.Generator().manual_seed(5)).tolist()
    images, captions, lengths = random_batch(model, 32, lengths, seed=5)
    batch = SimpleNamespace(images=images.pin_memory(), captions=captions.pin_memory(), lengths=lengths,
                            image_ids=torch.arange(32))
    # with hardest negatives the backward runs through the selected pairs (sgraf.training.pairs)
    config = preset("tiny").replace(module="sgr", precision=precision, max_violation=hardest, batch_size=32)
    optimizer = build_optimizer(model, config)
    assert optimizer.defaults["fused"]
    train_step(model, optimizer, batch, config, device="cuda")      # Adam's state is made here
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = train_step(model, optimizer, batch, config, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(result.loss) and math.isfinite(result.grad_norm)


def test_an_nccl_process_group_forms_and_sgrafs_collectives_run_over_it_on_the_device(monkeypatch):
    """The join as under torchrun (`distributed._join`: the rendezvous in another thread, which
    sets the CUDA device there too) over NCCL, then the collectives that evaluation and training
    call, with the device placement NCCL needs. One GPU takes one NCCL rank, so the group has one
    process and the collectives are forced on (they are skipped for one process)."""
    import socket

    import torch.distributed as dist
    from sgraf import distributed
    from sgraf.training import loop

    if not dist.is_nccl_available():
        pytest.skip("this PyTorch has no NCCL")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(port))):
        monkeypatch.setenv(name, value)
    distributed._join("nccl", torch.device("cuda", 0))
    try:
        assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
        monkeypatch.setattr(distributed, "is_distributed", lambda: True)
        rows = torch.randn(5, 3, device="cuda")
        (gathered,) = distributed.all_gather_variable(rows)
        assert gathered.device == rows.device and torch.equal(gathered, rows)
        on_host = distributed.all_gather_cat(rows.cpu())     # a host tensor goes through the GPU and back
        assert on_host.device.type == "cpu" and torch.equal(on_host, rows.cpu())
        assert distributed.all_reduce_mean(2.5) == 2.5
        assert loop._agree_on_stop(True) and not loop._agree_on_stop(False)
        distributed.barrier()
    finally:
        distributed.cleanup()
    assert not dist.is_initialized()


def test_the_caption_grus_backward_follows_the_float32_matmuls_precision_as_its_forward():
    """cuDNN reads its TF32 flag again when the GRU's backward builds its descriptor: a step called
    outside `sgraf train` (whose `tf32` context sets it for the whole run) had a TF32 backward."""
    from sgraf.training.config import preset
    from sgraf.training.step import build_optimizer, train_step

    model = random_model(7, module="sgr", num_regions=36, img_dim=64, embed_size=128, sim_dim=64).cuda().train()
    images, captions, lengths = random_batch(model, 16, [5] * 16, seed=5)
    batch = SimpleNamespace(images=images, captions=captions, lengths=lengths, image_ids=torch.arange(16))
    config = preset("tiny").replace(module="sgr", batch_size=16)
    seen = []
    rnn = next(module for module in model.modules() if isinstance(module, torch.nn.GRU))
    rnn.weight_hh_l0.register_hook(lambda grad: seen.append(torch.backends.cudnn.allow_tf32))  # in its backward
    cudnn, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = True, False   # PyTorch's defaults
        train_step(model, build_optimizer(model, config), batch, config, device="cuda")
        assert seen == [False] and torch.backends.cudnn.allow_tf32      # exact inside, put back after
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = cudnn, matmul


def test_the_selected_pairs_backward_gives_the_whole_matrix_gradients_on_the_device():
    """`sgraf.training.pairs` on CUDA (the pairs listed by topk, no read): the loss and the
    gradients of the backward through the whole matrix, within float32 noise."""
    from sgraf.model.blocks import copied
    from sgraf.training.config import preset
    from sgraf.training.step import train_step

    model = random_model(11, module="sgr", num_regions=36, img_dim=64, embed_size=128, sim_dim=64).cuda().train()
    lengths = torch.randint(3, 20, (32,), generator=torch.Generator().manual_seed(6)).tolist()
    images, captions, lengths = random_batch(model, 32, lengths, seed=6)
    batch = SimpleNamespace(images=images.cuda(), captions=captions.cuda(), lengths=lengths, image_ids=torch.arange(32))
    results = {}
    for by_pairs in (False, True):
        copy_ = copied(model)
        config = preset("tiny").replace(module="sgr", max_violation=True, pair_backward=by_pairs, grad_clip=0.0,
                                        batch_size=32)
        loss = train_step(copy_, torch.optim.SGD(copy_.parameters(), lr=0.0), batch, config, device="cuda").loss
        results[by_pairs] = loss, {name: p.grad for name, p in copy_.named_parameters() if p.grad is not None}
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    scale = largest(results[False][1])
    for name, grad in results[False][1].items():
        assert_close(results[True][1][name], grad, GRADIENT, scale=scale, what=name)


def test_a_non_finite_step_is_skipped_on_the_device_and_raises_when_read():
    """Fused Adam on CUDA skips the update of a step whose loss is not finite (`found_inf`) without
    the host asking; the error comes when the result is read, naming the bad image."""
    from sgraf.training.config import preset
    from sgraf.training.step import NonFiniteLossError, build_optimizer, train_step

    model = random_model(3, module="sgr").cuda().train()
    images, captions, lengths = random_batch(model, 4, [3, 4, 2, 5])
    images[2, 1, 0] = float("nan")
    batch = SimpleNamespace(images=images.pin_memory(), captions=captions.pin_memory(), lengths=lengths,
                            image_ids=torch.arange(4) + 10)
    config = preset("tiny").replace(module="sgr")
    optimizer = build_optimizer(model, config)
    assert optimizer.defaults["fused"]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    result = train_step(model, optimizer, batch, config, device="cuda")
    with pytest.raises(NonFiniteLossError, match=r"on non-finite inputs: the features of images \[12\]"):
        result.loss
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_a_timed_stage_ends_when_the_device_has_finished_its_work():
    """`sgraf evaluate --timings`: kernels queued in a stage are charged to it, not to the next."""
    from sgraf.stopwatch import Stopwatch

    watch = Stopwatch(device="cuda")
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    with watch.stage("work"):
        for _ in range(20):
            x = torch.tanh(x @ x)
    assert torch.cuda.current_stream().query()      # nothing left running after the stage
    assert watch.report()["work"] > 0


def test_images_off_a_memory_map_are_read_ahead_into_page_locked_memory_and_encoded_as_on_the_cpu(tmp_path):
    """`blocks.read_ahead` on a CUDA device: the reading threads' page-locked batches, copied to
    the device beside the encoder, give the CPU's region embeddings; NaN in a later batch is
    named when it is reached."""
    import numpy as np

    from sgraf.errors import InputError
    from sgraf.model import blocks

    model = random_model(img_dim=20, num_regions=5)
    features = np.random.default_rng(0).standard_normal((37, 5, 20)).astype(np.float32)
    np.save(tmp_path / "f.npy", features)
    mapped = np.load(tmp_path / "f.npy", mmap_mode="r")
    cpu = blocks.encode_images(model, mapped, batch_size=4)
    with blocks.read_ahead(mapped, 4, "f.npy", 0, torch.device("cuda")) as batches:
        assert all(batch.is_pinned() for _, batch in batches)
    gpu = blocks.encode_images(model.cuda(), mapped, batch_size=4)
    assert gpu.device.type == "cuda" and (gpu.cpu() - cpu).abs().max() <= 1e-5
    features[29, 3, 7] = np.inf
    np.save(tmp_path / "f.npy", features)
    with pytest.raises(InputError, match="image 29"):
        blocks.encode_images(model, np.load(tmp_path / "f.npy", mmap_mode="r"), batch_size=4)


def test_captions_encoded_on_the_device_in_a_scoring_blocks_buckets_give_the_cpus_word_features():
    """On a CUDA device the caption buckets hold `GPU_CAPTION_BLOCK` captions; their word features
    are the CPU's (buckets of 128) for the same captions."""
    from sgraf.model import blocks

    model = random_model()
    lengths = torch.randint(2, 30, (1500,), generator=torch.Generator().manual_seed(0))
    token_ids = [[4 + (i * 7 + j) % 25 for j in range(int(n))] for i, n in enumerate(lengths)]
    cpu = blocks.merge_buckets(blocks.encode_token_buckets(model, token_ids), blocks.GPU_CAPTION_BLOCK)
    gpu = blocks.encode_token_buckets(model.cuda(), token_ids)
    assert [len(b.index) for b in gpu] == [blocks.GPU_CAPTION_BLOCK, 1500 - blocks.GPU_CAPTION_BLOCK]
    for on_cpu, on_gpu in zip(cpu, gpu):
        assert torch.equal(on_cpu.index, on_gpu.index)
        assert (on_gpu.embs.cpu() - on_cpu.embs).abs().max() <= 1e-5


def test_ranks_are_counted_on_the_device_as_numpy_counts_them():
    """A CUDA score matrix stays on the device for its metrics (`sgraf.metrics`); the ranks, ties
    included, are NumPy's."""
    from sgraf import metrics

    generator = torch.Generator().manual_seed(3)
    sims = torch.randint(0, 5, (40, 200), generator=generator).float()     # many ties
    assert isinstance(metrics.as_score_matrix(sims.cuda()), torch.Tensor)
    for got, expected in zip(metrics.i2t_ranks(sims.cuda()) + metrics.t2i_ranks(sims.cuda()),
                             metrics.i2t_ranks(sims.numpy()) + metrics.t2i_ranks(sims.numpy())):
        assert (got == expected).all()
    assert metrics.evaluate_sims(sims.cuda(), folds=5) == metrics.evaluate_sims(sims.numpy(), folds=5)


def test_evaluate_on_the_device_counts_the_metrics_of_the_matrix_it_returns():
    """`evaluate_checkpoints_with_sims` on CUDA: the matrix stays there for the metrics, then
    comes to the host as a NumPy array; the metrics are NumPy's of that array, and the matrix is
    the CPU's within float32 noise."""
    from sgraf import metrics
    from sgraf.evaluate import evaluate_checkpoints_with_sims

    e2e = DATA / "e2e"
    args = ([e2e / "sgr.pth.tar"], e2e / "data" / "toy_precomp", "test")
    kwargs = dict(vocab=e2e / "data" / "toy_vocab.json")
    _, cpu_sims = evaluate_checkpoints_with_sims(*args, device="cpu", **kwargs)
    on_gpu, gpu_sims = evaluate_checkpoints_with_sims(*args, device="cuda", **kwargs)
    assert isinstance(gpu_sims, type(cpu_sims)) and gpu_sims.shape == cpu_sims.shape
    assert abs(gpu_sims - cpu_sims).max() <= 1e-5
    assert on_gpu == metrics.evaluate_sims(gpu_sims)


def test_an_ensemble_on_the_device_is_the_float64_mean_of_its_models_matrices(tmp_path):
    """SGR + SAF on CUDA: the share is kept in float64 there (`blocks.ENSEMBLE_DTYPE`), comes to
    the host and to --save-sims's file in float64 band by band (`HostCopy`), and is exactly the
    mean of the two models' own CUDA matrices, as the authors average; the metrics are those of it."""
    import numpy as np

    from sgraf import metrics
    from sgraf.evaluate import evaluate_checkpoints_with_sims

    e2e = DATA / "e2e"
    data, vocab = e2e / "data" / "toy_precomp", e2e / "data" / "toy_vocab.json"
    singles = [evaluate_checkpoints_with_sims([e2e / f"{m}.pth.tar"], data, "test", vocab=vocab, device="cuda")[1]
               for m in ("sgr", "saf")]
    result, both = evaluate_checkpoints_with_sims([e2e / "sgr.pth.tar", e2e / "saf.pth.tar"], data, "test",
                                                  vocab=vocab, device="cuda", save_sims=tmp_path / "both.npy")
    assert singles[0].dtype == np.float32 and both.dtype == np.float64
    assert np.array_equal(both, (singles[0].astype(np.float64) + singles[1]) / 2)
    assert np.array_equal(np.load(tmp_path / "both.npy"), both)
    assert result == metrics.evaluate_sims(both)


def test_host_copy_copies_cuda_bands_on_its_stream_while_the_scoring_stream_goes_on(tmp_path):
    """`HostCopy` on a CUDA matrix: each band is copied once the kernels that wrote it have run
    (an event on the scoring stream), on the worker's own stream, while later kernels on the
    scoring stream write the next rows; the host matrix and the file written from it are the
    device's, band and rest."""
    import numpy as np

    from sgraf.model.host_copy import HostCopy

    torch.manual_seed(0)
    share = torch.zeros(1024, 4096, device="cuda")
    parts = torch.randn(4, 256, 4096, device="cuda")
    with HostCopy(tuple(share.shape), file=tmp_path / "sims.npy") as copy:
        for band in range(3):            # the last 256 rows are handed over by no band
            rows = slice(256 * band, 256 * (band + 1))
            share[rows] = (parts[band] @ parts[band].T @ parts[band]).tanh()   # enough work to overlap
            copy.band(share, rows)
        share[768:] = parts[3].exp()
        host = copy.result(share)
        assert copy._stream is not None and copy._stream != torch.cuda.current_stream()
    assert (torch.from_numpy(host) == share.cpu()).all()
    assert np.array_equal(np.load(tmp_path / "sims.npy"), share.cpu().numpy())


def test_a_training_state_saved_where_more_gpus_were_visible_restores_on_this_one():
    """`last.pt` keeps every visible GPU's generator; a state with one more than this machine has
    (saved on a larger node) restores this GPU's and draws as the saved generator did (restoring all
    had raised IndexError past the device count)."""
    from sgraf.training.state import capture_rng_state, restore_rng_state

    torch.cuda.manual_seed(5)
    torch.rand(4, device="cuda")                         # CUDA initialised, the generator advanced
    state = capture_rng_state()
    expected = torch.rand(8, device="cuda")
    state["cuda"] = [*state["cuda"], state["cuda"][0].clone()]   # one GPU more than this process sees
    restore_rng_state(state)
    assert torch.equal(torch.rand(8, device="cuda"), expected)
