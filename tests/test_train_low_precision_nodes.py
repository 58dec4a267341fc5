"""The word nodes under bf16 (and fp16) autocast without a (word x feature) tensor kept for
backward (`_LowPrecisionLocalNodes`): the same values and gradients, bit for bit, as autograd
through autocast, whether their elementwise passes run over the whole chunk or image tile by
image tile (`plan.cache_tiles`) or fused (`sgraf.kernels.compiled.elementwise`: under
`SGRAF_COMPILE=train`, and by default for large CPU chunks, eagerly where compiling fails), and
a training step whose chunks are computed once instead of twice."""

from __future__ import annotations

import pytest
import torch

from model_helpers import needs_compile, random_model, step_gradients, training_batch
from sgraf import torch_compat
from sgraf.kernels import nodes as nodes_kernels
from sgraf.kernels import plan
from sgraf.model import similarity
from sgraf.model.norms import l2norm
from sgraf.training.config import preset

LOW = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(aligned: bool, weight_dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    n_img, n_cap, n_words, n_regions, dim, out = 3, 4, 5, 6, 16, 8
    regions = torch.randn(n_img, n_regions, dim, generator=generator)
    attn = torch.randn(n_img, 1 if aligned else n_cap, n_words, n_regions, generator=generator).softmax(-1)
    words = torch.randn(n_img if aligned else n_cap, 1 if aligned else n_words, *(
        (n_words, dim) if aligned else (dim,)), generator=generator)
    weight = torch.randn(out, dim, generator=generator).to(weight_dtype)
    bias = torch.randn(out, generator=generator).to(weight_dtype)
    return [t.requires_grad_() for t in (attn, regions, words, weight, bias)]


def _autograd_nodes(attn, regions, words, weight, bias):
    """What `local_nodes` computed under autocast before: plain autograd."""
    n_img, n_cap, n_words, n_regions = attn.shape
    context = (attn.reshape(n_img, n_cap * n_words, n_regions) @ regions).view(n_img, n_cap, n_words, -1)
    words = words if words.dim() == 4 else words.unsqueeze(0)
    return l2norm(torch.nn.functional.linear(similarity.squared_difference(context, words), weight, bias))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("aligned", [False, True], ids=["grid", "aligned"])
@pytest.mark.parametrize("weights", ["float32", "low"], ids=["float32-weights", "low-weights"])
@pytest.mark.parametrize("tiles", ["whole", "per-image"])
def test_the_light_nodes_give_autograds_values_and_gradients_bit_for_bit(precision, aligned, weights, tiles,
                                                                          monkeypatch):
    low = LOW[precision]
    if tiles == "per-image":
        monkeypatch.setattr(plan, "TILE_BYTES", 1)
        assert len(plan.cache_tiles(3, 4, "cpu")) == 3
    results = []
    for nodes in (similarity.local_nodes, _autograd_nodes):
        inputs = _inputs(aligned, torch.float32 if weights == "float32" else low)
        with torch.autocast("cpu", dtype=low):
            out = nodes(*inputs)
        assert out.dtype == low
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(low)
        out.backward(grad)
        results.append([out.detach()] + [t.grad for t in inputs])
    light, reference = results
    for name, a, b in zip(["nodes", "attn", "regions", "words", "weight", "bias"], light, reference):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_the_light_nodes_are_taken_under_autocast_only_for_float32_or_the_autocast_dtype(monkeypatch):
    applied = []
    original = nodes_kernels._LowPrecisionLocalNodes.apply
    monkeypatch.setattr(nodes_kernels._LowPrecisionLocalNodes, "apply",
                        lambda *args: applied.append(args[-1]) or original(*args))
    inputs = _inputs(False, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        similarity.local_nodes(*inputs)
        similarity.local_nodes(*[t.detach().double() for t in inputs])        # float64: plain autograd
    similarity.local_nodes(*inputs)                                            # float32: `_LocalNodes`
    assert applied == [torch.bfloat16]


def _step(model, batch, precision, monkeypatch, light):
    if not light:
        monkeypatch.setattr(nodes_kernels, "light_dtype", lambda *args: None)
    recomputed = []
    checkpoint = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint",
                        lambda function, *args, **kwargs: recomputed.append(function.__name__)
                        or checkpoint(function, *args, **kwargs))
    result, grads = step_gradients(model, batch, preset("tiny").replace(precision=precision, grad_clip=0.0))
    monkeypatch.undo()
    return result.loss, grads, recomputed


@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_a_bf16_step_with_light_nodes_gives_the_same_loss_and_gradients_computing_each_chunk_once(
        module, monkeypatch):
    model = random_model(module=module)
    model.train_chunk = 3
    batch = training_batch(model, [3, 7, 5, 2, 7, 4, 6, 3])
    loss, grads, recomputed = _step(model, batch, "bf16", monkeypatch, light=True)
    heavy_loss, heavy_grads, heavy_recomputed = _step(model, batch, "bf16", monkeypatch, light=False)
    # before: every chunk recomputed whole in backward; now its nodes once and its heads kept
    assert heavy_recomputed == ["chunk_scores"] * 3 and recomputed == []
    assert loss == heavy_loss
    assert grads.keys() == heavy_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], heavy_grads[name]), name

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("module", ["sgr", "saf"])
def test_a_model_without_word_nodes_trains_under_autocast_computing_each_chunk_once(module, precision, monkeypatch):
    """Global alignments only (Table 3's ablation): no local layer to ask for its dtype (a step under
    autocast raised AttributeError on `sim_tranloc_w`), and nothing (word x feature) to keep."""
    model = random_model(module=module, alignments="global")
    model.train_chunk = 3
    batch = training_batch(model, [3, 7, 5, 2, 7, 4, 6, 3])
    loss, grads, recomputed = _step(model, batch, precision, monkeypatch, light=True)
    assert recomputed == [] and torch.isfinite(torch.tensor(loss))
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads.values())
    assert "sim_enc.sim_tranglo_w.weight" in grads


# ------------------------------------------------------------------ the fused passes (SGRAF_COMPILE=train)

def _fresh_elementwise(monkeypatch, backend: str) -> None:
    """The nodes' compiled functions built anew on `backend` (another test may have built them)."""
    from sgraf.kernels import compiled

    monkeypatch.setattr(compiled, "BACKEND", backend)
    for function in (nodes_kernels._squares, nodes_kernels._square_and_gradient):
        monkeypatch.delitem(compiled._compiled, function, raising=False)


@needs_compile
def test_the_fused_passes_under_inductor_give_autograds_bits(monkeypatch):
    from sgraf.kernels import compiled

    _fresh_elementwise(monkeypatch, "inductor")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # Inductor's loops serial: quick to build and run on a loaded machine
    try:
        results = []
        for fused in (True, False):
            inputs = _inputs(False, torch.float32)
            with compiled.compiling("train" if fused else "off"), torch.autocast("cpu", dtype=torch.bfloat16):
                out = similarity.local_nodes(*inputs)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
            results.append([out.detach()] + [t.grad for t in inputs])
    finally:
        torch.set_num_threads(threads)
    assert nodes_kernels._squares in compiled._compiled and nodes_kernels._square_and_gradient in compiled._compiled
    for name, a, b in zip(["nodes", "attn", "regions", "words", "weight", "bias"], *results):
        assert torch.equal(a, b), name


@needs_compile
def test_the_fused_passes_compile_once_for_every_chunk_shape(monkeypatch):
    """Dynamic shapes: one forward and one backward graph for chunks of any size (of sizes above
    one), one more pair for aligned words (one caption per image), and none for words that need
    no gradient."""
    import torch._dynamo

    from sgraf.kernels import compiled

    _fresh_elementwise(monkeypatch, "aot_eager")

    def graphs() -> int:
        return torch._dynamo.utils.counters["stats"]["unique_graphs"]

    def nodes(n_img, n_cap, n_words, aligned=False):
        generator = torch.Generator().manual_seed(n_img * 100 + n_cap)
        attn = torch.randn(n_img, 1 if aligned else n_cap, n_words, 6, generator=generator).softmax(-1)
        words = torch.randn(*((n_img, 1) if aligned else (n_cap,)), n_words, 16, generator=generator)
        inputs = [t.requires_grad_() for t in (attn, torch.randn(n_img, 6, 16, generator=generator), words,
                                              torch.randn(8, 16, generator=generator), torch.zeros(8))]
        with compiled.compiling("train"), torch.autocast("cpu", dtype=torch.bfloat16):
            similarity.local_nodes(*inputs).float().sum().backward()

    before = graphs()
    nodes(3, 4, 5)
    assert graphs() - before == 2
    for shape in [(5, 2, 7), (2, 6, 3), (4, 3, 9)]:
        nodes(*shape)
    assert graphs() - before == 2
    nodes(3, 4, 5, aligned=True)
    nodes(5, 4, 7, aligned=True)
    assert graphs() - before == 4
    # without autograd (the matrix a step scores to find its hardest negatives) the words need no
    # gradient: the passes take them detached either way, so nothing compiles again
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad(), compiled.compiling("train"), torch.autocast("cpu", dtype=torch.bfloat16):
        similarity.local_nodes(torch.randn(4, 3, 6, 6, generator=generator).softmax(-1),
                               torch.randn(4, 6, 16, generator=generator), torch.randn(3, 6, 16, generator=generator),
                               torch.randn(8, 16, generator=generator), torch.zeros(8))
    assert graphs() - before == 4


@needs_compile
def test_only_float32_words_take_the_fused_passes(monkeypatch):
    """With bf16 words eager rounds every intermediate to bf16 and a fused loop would not: they
    keep the eager passes under `SGRAF_COMPILE=train`."""
    from sgraf.kernels import compiled

    fused = []
    monkeypatch.setattr(compiled, "elementwise", lambda function: fused.append(function.__name__) or function)
    for words_dtype in (torch.bfloat16, torch.float32):
        attn, regions, words, weight, bias = _inputs(False, torch.float32)
        words = words.detach().to(words_dtype).requires_grad_()
        with compiled.compiling("train"), torch.autocast("cpu", dtype=torch.bfloat16):
            out = similarity.local_nodes(attn, regions, words, weight, bias)
            out.float().sum().backward()
        assert fused == ([] if words_dtype == torch.bfloat16 else ["_squares", "_square_and_gradient"])


# ------------------------------------------------------------------ the default (SGRAF_COMPILE=auto)

def test_auto_fuses_the_word_nodes_of_large_cpu_chunks_where_it_can_compile(monkeypatch):
    """The default fuses a chunk's passes on the CPU plan from `AUTO_ELEMENTWISE_MIN` values up,
    never on the GPU plan, nowhere when a C++ compiler or a PyTorch that compiles is missing,
    or under `off`; `train` fuses at any size."""
    from sgraf.kernels import compiled

    cxx_found = compiled._cxx_found
    monkeypatch.delenv("SGRAF_COMPILE", raising=False)
    monkeypatch.setattr(compiled, "_auto_failed", [])
    monkeypatch.setattr(torch_compat, "compile_supported", lambda: True)
    monkeypatch.setattr(compiled, "_cxx_found", lambda: True)
    large = compiled.AUTO_ELEMENTWISE_MIN
    assert compiled.fuses_word_nodes(large, cpu_plan=True)
    assert not compiled.fuses_word_nodes(large - 1, cpu_plan=True)
    assert not compiled.fuses_word_nodes(large, cpu_plan=False)
    monkeypatch.setattr(compiled, "_cxx_found", lambda: False)
    assert not compiled.fuses_word_nodes(large, cpu_plan=True)
    monkeypatch.setattr(compiled, "_cxx_found", lambda: True)
    monkeypatch.setattr(torch_compat, "compile_supported", lambda: False)
    assert not compiled.fuses_word_nodes(large, cpu_plan=True)
    monkeypatch.setattr(torch_compat, "compile_supported", lambda: True)
    with compiled.compiling("off"):
        assert not compiled.fuses_word_nodes(large, cpu_plan=True)
    with compiled.compiling("train"):
        assert compiled.fuses_word_nodes(1, cpu_plan=False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert not cxx_found()


def _failing_compile(monkeypatch):
    """Every compilation fails as on a machine without a C++ compiler; the nodes' compiled
    functions built anew."""
    from sgraf.kernels import compiled

    def compile_fails(function, dynamic):
        def call(*args):
            raise RuntimeError("InductorError: no C++ compiler\nmore detail")
        return call

    monkeypatch.setattr(compiled, "_torch_compile", compile_fails)
    monkeypatch.setattr(compiled, "_auto_failed", [])
    monkeypatch.setattr(torch_compat, "compile_supported", lambda: True)   # as a newer PyTorch (none compiles here)
    for function in (nodes_kernels._squares, nodes_kernels._square_and_gradient):
        monkeypatch.delitem(compiled._compiled, function, raising=False)


def test_under_auto_a_failed_compilation_runs_the_same_passes_eagerly_with_one_warning(monkeypatch, caplog):
    """A machine without a C++ compiler on the path's usual names, or a compiler that fails: the
    default does not stop the run."""
    from sgraf.kernels import compiled

    _failing_compile(monkeypatch)
    caplog.set_level("INFO", logger="sgraf.kernels.compiled")
    monkeypatch.setattr(compiled, "_auto_announced", [])
    monkeypatch.delenv("SGRAF_COMPILE", raising=False)
    monkeypatch.setattr(compiled, "AUTO_ELEMENTWISE_MIN", 1)
    monkeypatch.setattr(compiled, "_cxx_found", lambda: True)
    results = []
    for setting in ("auto", "off"):
        inputs = _inputs(False, torch.float32)
        with compiled.compiling(setting), torch.autocast("cpu", dtype=torch.bfloat16):
            out = similarity.local_nodes(*inputs)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
        results.append([out.detach()] + [t.grad for t in inputs])
    for name, a, b in zip(["nodes", "attn", "regions", "words", "weight", "bias"], *results):
        assert torch.equal(a, b), name
    warnings = [r.getMessage() for r in caplog.records if "could not compile" in r.getMessage()]
    assert warnings == ["could not compile the bf16 word nodes' passes (RuntimeError: InductorError: no C++ "
                        "compiler); they run eagerly, with the same values (SGRAF_COMPILE=off skips compiling)"]
    assert not compiled.fuses_word_nodes(10**9, cpu_plan=True)      # eager for the rest of the process
    # the first compilation is announced once (a step that pauses says why)
    assert [r.getMessage() for r in caplog.records].count(
        "compiling the bf16 word nodes' fused passes (once per process, some seconds; SGRAF_COMPILE=off runs "
        "them eagerly)") == 1


def test_under_train_a_failed_compilation_is_an_error(monkeypatch):
    from sgraf.kernels import compiled

    _failing_compile(monkeypatch)
    inputs = _inputs(False, torch.float32)
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        with compiled.compiling("train"), torch.autocast("cpu", dtype=torch.bfloat16):
            similarity.local_nodes(*inputs)


def test_a_default_bf16_step_fuses_its_large_chunks_only(monkeypatch):
    """Under the default a training step's chunks above the size take the fused functions (here
    run as they are, not compiled), the others the eager tiles: the same loss and gradients."""
    from sgraf.kernels import compiled

    monkeypatch.delenv("SGRAF_COMPILE", raising=False)
    monkeypatch.setattr(compiled, "_auto_failed", [])
    monkeypatch.setattr(compiled, "_cxx_found", lambda: True)
    monkeypatch.setattr(torch_compat, "compile_supported", lambda: True)
    fused = []
    monkeypatch.setattr(compiled, "elementwise", lambda function: fused.append(function.__name__) or function)
    model = random_model(module="saf")
    model.train_chunk = 3
    batch = training_batch(model, [3, 7, 5, 2, 7, 4, 6, 3])
    config = preset("tiny").replace(precision="bf16", grad_clip=0.0)
    with compiled.compiling("off"):
        eager, eager_grads = step_gradients(model, batch, config)
    assert fused == []
    # chunks of 3, 3 and 2 captions (sorted by length) against 8 images: only the last two reach
    # the size set here (8 x 3 x 7 words and 8 x 2 x 7 words of `d` features, not 8 x 3 x 4)
    dim = model.config.embed_size
    monkeypatch.setattr(compiled, "AUTO_ELEMENTWISE_MIN", 8 * 2 * 7 * dim)
    result, grads = step_gradients(model, batch, config)
    assert fused.count("_squares") == 2 and fused.count("_square_and_gradient") == 2
    assert result.loss == eager.loss
    for name in grads:
        assert torch.equal(grads[name], eager_grads[name]), name
