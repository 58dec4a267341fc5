"""`sgraf serve`: the JSON API through FastAPI's test client, the service and worker functions,
the command line."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from numerics import REORDERED, assert_close  # noqa: E402
from sgraf.checkpoint import save_model  # noqa: E402
from sgraf.cli import main  # noqa: E402
from sgraf.config import ModelConfig  # noqa: E402
from sgraf.data.vocab import Vocabulary  # noqa: E402
from sgraf.explain import explain_pair  # noqa: E402
from sgraf.model.sgraf import SGRAF  # noqa: E402
from sgraf.serve.app import create_app  # noqa: E402
from sgraf.serve.service import MAX_TEXT_CHARS, NotFound, SearchService  # noqa: E402
from sgraf.serve.worker import Busy, Worker  # noqa: E402

WORDS = "a dog cat runs on the grass man woman red blue ball plays with in park".split()
N_IMG, CAPS, K, IMG_DIM = 12, 5, 9, 12
SRC = Path(__file__).resolve().parents[1] / "src"


def _model(module: str, vocab: Vocabulary, seed: int) -> SGRAF:
    torch.manual_seed(seed)
    config = ModelConfig(vocab_size=len(vocab), img_dim=IMG_DIM, word_dim=8, embed_size=16, sim_dim=8,
                         num_regions=K, module=module, sgr_step=2)
    model = SGRAF(config)
    model.vocab = vocab
    return model.eval()


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> dict:
    """A 12-image gallery with pictures (3 x 3 region grid), an SGR + SAF index, and a secret."""
    root = tmp_path_factory.mktemp("serve")
    rng = np.random.default_rng(5)
    data = root / "data"
    (data / "images" / "test").mkdir(parents=True)
    features = rng.standard_normal((N_IMG, K, IMG_DIM)).astype(np.float32)
    captions = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 9)))) for _ in range(N_IMG * CAPS)]
    np.save(data / "test_ims.npy", features)
    (data / "test_caps.txt").write_text("\n".join(captions) + "\n")
    for i in range(N_IMG):
        pixels = rng.integers(0, 255, (24, 24, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(data / "images" / "test" / f"{i:05d}.png")
    (root / "secret.png").write_bytes(b"not for the web")
    (data / "images" / "test" / "notes.txt").write_text("a file that is not a picture")
    vocab = Vocabulary.from_words(WORDS)
    paths = []
    for module, seed in (("sgr", 1), ("saf", 2)):
        path = root / f"{module}.pt"
        save_model(_model(module, vocab, seed), path, vocab=vocab)
        paths.append(str(path))
    index = root / "index"
    assert main(["index", "--checkpoint", paths[0], "--checkpoint", paths[1], "--data", str(data),
                 "--split", "test", "--out", str(index)]) == 0
    return {"root": root, "data": data, "features": features, "captions": captions, "paths": paths,
            "index": index}


@pytest.fixture(scope="module")
def service(gallery) -> SearchService:
    return SearchService.open(gallery["index"], shortlist=6)


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service)) as client:
        yield client


# --------------------------------------------------------------------------------- answers
def test_health_names_the_gallery_models_device_and_precision(client, gallery):
    answer = client.get("/api/health").json()
    manifest = json.loads((gallery["index"] / "manifest.json").read_text())
    assert answer["gallery"] == {"images": N_IMG, "captions": N_IMG * CAPS, "caps_per_image": CAPS}
    assert [m["weights_sha256"] for m in answer["models"]] == [m["weights_sha256"] for m in manifest["models"]]
    assert [m["module"] for m in answer["models"]] == ["sgr", "saf"]
    assert (answer["device"], answer["precision"], answer["shortlist"]) == ("cpu", "fp32", 6)
    assert answer["pictures"] and answer["explain"]


def test_precision_is_the_models_autocast(gallery, service):
    bf16 = SearchService.open(gallery["index"], precision="bf16", shortlist=N_IMG)
    assert bf16.health()["precision"] == "bf16" and bf16.matcher.precision == "bf16"
    query = "a red ball in the park"
    low = bf16.search_text(query, top_k=N_IMG)["results"]
    full = service.index.search_text(query, top_k=N_IMG, shortlist=N_IMG)
    assert sorted(r["id"] for r in low) == list(range(N_IMG))
    gap = max(abs(r["score"] - h.score) for r, h in zip(sorted(low, key=lambda r: r["id"]),
                                                        sorted(full, key=lambda h: h.id)))
    assert 0 < gap < 2e-2     # bfloat16 rounding, not another computation


def test_text_search_is_the_index_search_best_first_with_picture_urls(client, service):
    query = "a red ball in the park"
    answer = client.get("/api/search", params={"text": query, "top_k": 5}).json()
    expected = service.index.search_text(query, top_k=5, shortlist=6)
    assert answer["query"] == query and answer["ms"] > 0
    assert [r["id"] for r in answer["results"]] == [h.id for h in expected]
    assert_close(np.array([r["score"] for r in answer["results"]]), np.array([h.score for h in expected]), REORDERED)
    scores = [r["score"] for r in answer["results"]]
    assert scores == sorted(scores, reverse=True)
    assert [r["image"] for r in answer["results"]] == [f"/images/{h.id:05d}.png" for h in expected]
    picture = client.get(answer["results"][0]["image"])
    assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"


def test_top_k_above_the_shortlist_widens_the_shortlist(client, service):
    answer = client.get("/api/search", params={"text": "a dog", "top_k": 1000}).json()
    assert sorted(r["id"] for r in answer["results"]) == list(range(N_IMG))   # the whole gallery, ranked
    exhaustive = service.index.search_text("a dog", top_k=N_IMG, shortlist=None)
    assert [r["id"] for r in answer["results"]] == [h.id for h in exhaustive]


def test_image_search_returns_the_best_captions(client, service):
    answer = client.get("/api/search", params={"image_id": 3, "top_k": 4}).json()
    expected = service.index.search_image(image_id=3, top_k=4, shortlist=6)
    assert answer["query"] == {"image_id": 3, "image": "/images/00003.png", "name": None}   # no names recorded
    assert [(r["id"], r["caption"]) for r in answer["results"]] == [(h.id, h.text) for h in expected]
    assert [r["score"] for r in answer["results"]] == pytest.approx([h.score for h in expected], abs=1e-6)
    assert all(r["explainable"] for r in answer["results"])


def test_head_is_answered_where_get_reads_nothing_heavy(client):
    for path in ("/", "/images/00000.png", "/api/health", "/docs", "/static/app.js", "/openapi.json"):
        answer = client.head(path)
        assert answer.status_code == 200 and answer.content == b"", path
    refused = client.head("/api/search", params={"text": "a dog"})
    assert refused.status_code == 405 and refused.headers["allow"] == "GET"


def test_a_gallery_caption_past_the_text_limit_is_not_offered_for_explaining(service, monkeypatch):
    """The page had offered such captions, and the explanation was then refused."""
    assert service._explainable(0, service.index.captions[0])
    assert not service._explainable(0, "a " * 300)                       # 600 characters
    lengths = service.index.caption_lengths.copy()
    lengths[0] = 64 + 2 + 1                                              # 65 words and <start>, <end>
    monkeypatch.setattr(service.index, "caption_lengths", lengths)
    assert not service._explainable(0, service.index.captions[0])


def test_explain_is_what_explain_pair_computes(client, service, gallery):
    text = "the man plays with a blue ball"
    answer = client.get("/api/explain", params={"image_id": 2, "text": text}).json()
    expected = explain_pair(service.matcher, gallery["features"][2], text)
    assert answer["scores"] == pytest.approx(expected.scores, abs=1e-6)
    assert [n["label"] for n in answer["nodes"]] == expected.node_labels
    assert [n["saf_beta"] for n in answer["nodes"]] == pytest.approx(expected.saf_beta.tolist(), abs=1e-6)
    assert [n["sgr_alignment"] for n in answer["nodes"]] == pytest.approx(expected.sgr_alignment.tolist(), abs=1e-6)
    weights = np.array(answer["attention"]["weights"])
    assert weights.shape == (len(expected.tokens), K) and answer["attention"]["tokens"] == expected.tokens
    np.testing.assert_allclose(weights, expected.attention, atol=1e-6)
    assert np.allclose(weights.sum(axis=1), 1.0, atol=1e-5)
    regions = answer["regions"]
    assert [regions[k] for k in ("kind", "rows", "cols", "width", "height")] == ["grid", 3, 3, 24, 24]
    assert regions["boxes"][0] == [0, 0, 8, 8] and regions["boxes"][5] == [16, 8, 24, 16]   # row 1, column 2
    assert answer["image"] == "/images/00002.png"
    assert answer["unknown"] == []
    unknown = client.get("/api/explain", params={"image_id": 2, "text": "a zebra dog", "allow_unknown": "true"}).json()
    assert unknown["attention"]["tokens"][2] == "zebra" and unknown["unknown"] == [2]    # read as <unk>


def test_explain_png_is_the_explain_picture(client):
    response = client.get("/api/explain.png", params={"image_id": 1, "text": "a dog runs"})
    assert response.status_code == 200 and response.headers["content-type"] == "image/png"
    assert response.content[:8] == b"\x89PNG\r\n\x1a\n" and len(response.content) > 5000


# --------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("route, params, message", [
    ("/api/search", {"text": ""}, "text is empty"),
    ("/api/search", {"text": "   "}, "text is empty"),
    ("/api/search", {"text": "a " * 300}, f"the limit is {MAX_TEXT_CHARS}"),
    ("/api/search", {"text": "a zebra runs"}, "'zebra' not in the model's vocabulary"),
    ("/api/search", {"text": "a dog", "top_k": 0}, "top_k must be an integer in 1..1000, got 0"),
    ("/api/search", {"text": "a dog", "top_k": 1001}, "top_k must be an integer in 1..1000, got 1001"),
    ("/api/search", {"text": "a dog", "top_k": "ten"}, "top_k must be an integer, got 'ten'"),
    ("/api/search", {"image_id": N_IMG}, f"image_id {N_IMG} is out of range: the gallery holds images 0..{N_IMG - 1}"),
    ("/api/search", {"image_id": -1}, "image_id -1 is out of range"),
    ("/api/search", {"image_id": "first"}, "image_id must be an integer, got 'first'"),
    ("/api/search", {"image_id": "1_0"}, "image_id must be an integer, got '1_0'"),      # had read 10
    ("/api/search", {"image_id": "1.0"}, "image_id must be an integer, got '1.0'"),      # had read 1
    ("/api/search", {"text": "a dog", "top_k": "1_0"}, "top_k must be an integer, got '1_0'"),
    ("/api/search", {"text": "a dog", "top_k": ["2", "3"]}, "query parameter 'top_k' is given twice"),
    ("/api/search", {"text": "a dog", "top_k": "+5"}, "top_k must be an integer, got '+5'"),           # had read 5
    ("/api/search", {"image_id": "9" * 13}, "image_id must be an integer of at most 12 digits"),
    ("/api/search", {"image_id": "-" + "9" * 13}, "image_id must be an integer of at most 12 digits"),
    ("/api/search", {"text": "a dog", "image_id": 1}, "give either text or image_id, not both"),
    ("/api/search", {}, "give either text=... (text -> images) or image_id=N"),
    ("/api/explain", {"image_id": 1}, "text is missing"),
    ("/api/explain", {"image_id": 99, "text": "a dog"}, "image_id 99 is out of range"),
    ("/api/explain", {"image_id": 1, "text": "a zebra"}, "'zebra' not in the model's vocabulary"),
    ("/api/explain.png", {"image_id": 1, "text": ""}, "text is empty"),
])
def test_bad_requests_are_400_json_errors_naming_the_problem(client, route, params, message):
    response = client.get(route, params=params)
    assert response.status_code == 400
    assert list(response.json()) == ["error"] and message in response.json()["error"]


def test_a_routes_query_check_leaves_other_paths_and_parameters_alone(client):
    """The query check had run on every /api/ path: an unknown path answered 400 instead of 404,
    and a parameter a route does not take was refused."""
    assert client.get("/api/nothing", params=[("x", "1"), ("x", "2")]).status_code == 404
    assert client.get("/api/health", params={"image_id": "abc"}).status_code == 200
    assert client.get("/api/explain", params={"image_id": 0, "text": "a dog", "top_k": "abc"}).status_code == 200


def test_one_spelling_of_each_picture_and_no_redirect_built_from_the_host(client):
    assert client.get("/images/00000.png").status_code == 200
    for path in ("/images/00000.png/", "/images//00000.png"):      # (the test client drops a "./" itself)
        assert client.get(path).status_code == 404, path
    with pytest.raises(NotFound):
        client.app.state.service.picture_file("./00000.png")
    answer = client.get("/api/search/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert answer.status_code == 404 and "location" not in answer.headers


def test_headers_past_the_limit_are_refused_in_json(client):
    answer = client.get("/api/health", headers={"X-Big": "a" * 20000})
    assert answer.status_code == 400 and "request headers of more than 16384 bytes" in answer.json()["error"]
    assert answer.headers["connection"] == "close"
    assert answer.headers["x-content-type-options"] == "nosniff"


def test_unknown_words_map_to_unk_when_asked(client):
    response = client.get("/api/search", params={"text": "a zebra runs", "allow_unknown": "true", "top_k": 3})
    assert response.status_code == 200 and len(response.json()["results"]) == 3
    response = client.get("/api/explain", params={"image_id": 0, "text": "a zebra", "allow_unknown": "true"})
    assert response.status_code == 200 and [n["label"] for n in response.json()["nodes"]][3] == "zebra"


@pytest.mark.parametrize("path", [
    "/images/%2e%2e/%2e%2e/secret.png",      # climbs out of the picture folder
    "/images/..%2f..%2fsecret.png",
    "/images//etc/passwd",                    # absolute
    "/images/%2Fetc%2Fpasswd",
    "/images/escape.png",                     # a link inside that leads out
    "/images/notes.txt",                      # inside, but not a picture
    "/images/99999.png",                      # not there
    "/images/",
])
def test_pictures_outside_the_picture_folder_are_404(client, gallery, path):
    link = gallery["data"] / "images" / "test" / "escape.png"
    if not link.is_symlink():
        link.symlink_to(gallery["root"] / "secret.png")
    response = client.get(path)
    assert response.status_code == 404 and "error" in response.json()
    assert b"not for the web" not in response.content


def test_picture_file_resolves_only_inside_the_folder(service, gallery):
    assert service.picture_file("00004.png") == (gallery["data"] / "images" / "test" / "00004.png").resolve()
    for bad in ("../../secret.png", str(gallery["root"] / "secret.png"), "", "a/../../x.png"):
        with pytest.raises(NotFound):
            service.picture_file(bad)


def test_unknown_routes_are_json_404(client):
    response = client.get("/api/nothing")
    assert response.status_code == 404 and response.json() == {"error": "Not Found"}


# --------------------------------------------------------------------------------- concurrency
def _block(worker: Worker) -> threading.Event:
    """Occupy the worker thread until the returned event is set."""
    release, started = threading.Event(), threading.Event()
    worker.call(lambda: (started.set(), release.wait(10)))
    assert started.wait(10)
    return release


def test_a_full_queue_answers_503_with_retry_after(service):
    with TestClient(create_app(service, max_queue=2, max_batch=4)) as client:
        worker = client.app.state.worker
        release = _block(worker)
        try:
            waiting = [worker.call(lambda: None) for _ in range(2)]          # the queue is full now
            response = client.get("/api/search", params={"text": "a dog"})
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            assert response.json()["error"] == "the server is busy: 2 requests are waiting; retry shortly"
            with pytest.raises(Busy):
                worker.search_text("a dog", 3, 6)
        finally:
            release.set()
        for future in waiting:
            future.result(10)
        assert client.get("/api/search", params={"text": "a dog"}).status_code == 200
        assert client.get("/api/health").json()["queue"]["busy"] == 2        # the 503 and the refused call


def test_explanations_hold_at_most_half_the_queue_so_searches_keep_places(service):
    """66 clients looping explanation pictures had filled the queue: 64 of 66 searches got 503."""
    with TestClient(create_app(service, max_queue=4, max_batch=4)) as client:
        worker = client.app.state.worker
        assert worker.max_heavy == 2 and client.get("/api/health").json()["queue"]["max_heavy"] == 2
        release = _block(worker)
        try:
            heavy = [worker.call(lambda: None, heavy=True) for _ in range(2)]
            response = client.get("/api/explain", params={"image_id": 1, "text": "a dog"})
            assert response.status_code == 503 and response.headers["Retry-After"] == "1"
            assert response.json()["error"] == "the server is busy: 2 explanations are waiting; retry shortly"
            light = [worker.call(lambda: None) for _ in range(2)]           # the searches' places are free
            with pytest.raises(Busy, match="4 requests are waiting"):
                worker.search_text("a dog", 3, 6)
        finally:
            release.set()
        for future in heavy + light:
            future.result(10)
        assert client.get("/api/explain", params={"image_id": 1, "text": "a dog"}).status_code == 200


def test_texts_that_wait_together_are_scored_as_one_batch(service):
    worker = Worker(service, max_queue=16, max_batch=8).start()
    try:
        queries = ["a dog", "a red ball in the park", "the woman runs", "a cat plays with a blue ball"]
        release = _block(worker)
        futures = [worker.search_text(q, 2 + i, 6) for i, q in enumerate(queries)]
        image = worker.call(service.search_image, 0, 3)
        before = worker.batches
        release.set()
        answers = [f.result(30) for f in futures]
        assert (worker.batches - before, worker.batched_texts) == (1, len(queries))
        for i, (query, answer) in enumerate(zip(queries, answers)):
            alone = service.search_text(query, top_k=2 + i)["results"]
            assert [r["id"] for r in answer] == [r["id"] for r in alone]
            assert_close(np.array([r["score"] for r in answer]), np.array([r["score"] for r in alone]), REORDERED)
        assert len(image.result(30)["results"]) == 3
    finally:
        worker.stop()


def test_several_compute_threads_answer_as_one(service):
    worker = Worker(service, max_queue=32, max_batch=3, threads=2).start()
    threads = list(worker._threads)
    queries = ["a dog", "a red ball in the park", "the woman runs", "a cat", "blue grass", "a man plays"]
    try:
        futures = [worker.search_text(q, 3, 6) for q in queries] + [worker.call(service.search_image, 1, 2)]
        answers = [f.result(30) for f in futures]
    finally:
        worker.stop()
    assert len(threads) == 2 and not any(thread.is_alive() for thread in threads)
    for query, answer in zip(queries, answers):
        assert [r["id"] for r in answer] == [r["id"] for r in service.search_text(query, top_k=3)["results"]]
    assert len(answers[-1]["results"]) == 2


def test_scoring_runs_off_the_event_loop(service):
    with TestClient(create_app(service)) as client:
        worker = client.app.state.worker
        release = _block(worker)
        try:
            # the worker is busy, yet the event loop still answers what needs no model
            assert client.get("/api/health").json()["queue"]["waiting"] == 0
            assert client.get("/images/00000.png").status_code == 200
        finally:
            release.set()


# --------------------------------------------------------------------------------- pages
def test_the_page_and_its_files_come_from_the_package_without_outside_links(client):
    page = client.get("/")
    assert page.status_code == 200 and 'id="query"' in page.text and "/static/app.js" in page.text
    for path in ("/", "/static/app.js", "/static/style.css", "/docs"):
        text = client.get(path).text
        assert client.get(path).status_code == 200
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, path


def test_docs_and_openapi_describe_the_api(client):
    schema = client.get("/openapi.json").json()
    assert "422" not in client.get("/openapi.json").text            # invalid parameters are answered 400
    assert {"/api/search", "/api/explain", "/api/explain.png", "/api/health"} <= set(schema["paths"])
    names = {p["name"] for p in schema["paths"]["/api/search"]["get"]["parameters"]}
    assert names == {"text", "image_id", "top_k", "allow_unknown"}
    docs = client.get("/docs").text
    assert "GET /api/search" in docs and "top_k" in docs and "/openapi.json" in docs
    # the descriptions' Markdown is rendered, never shown as backticks
    assert "`" not in docs
    assert "<code>image_id</code>" in docs and "<code>sgraf explain</code>" in docs and "<code>Retry-After</code>" in docs


# --------------------------------------------------------------------------------- command line
def test_serve_refuses_a_corrupt_index_with_the_search_message(gallery, tmp_path, capsys):
    copy = tmp_path / "index"
    shutil.copytree(gallery["index"], copy)
    target = copy / "image_regions.0.npy"
    target.write_bytes(target.read_bytes()[:-64])
    assert main(["search", "--index", str(copy), "--text", "a dog"]) == 2
    search_error = capsys.readouterr().err
    assert main(["serve", "--index", str(copy), "--port", "0"]) == 2
    serve_error = capsys.readouterr().err
    assert "image_regions.0.npy: corrupted index file" in serve_error
    assert serve_error.replace("sgraf serve:", "") == search_error.replace("sgraf search:", "")


def test_serve_without_fastapi_names_the_extra(gallery, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)      # as if not installed
    assert main(["serve", "--index", str(gallery["index"])]) == 2
    err = capsys.readouterr().err
    assert "pip install 'sgraf[serve]'" in err and err.count("\n") == 1


def test_import_sgraf_and_help_do_not_import_the_web_stack():
    code = ("import sys, sgraf, sgraf.serve; from sgraf.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(SRC)}).stdout
    assert out.strip() == "[]"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_serve_command_answers_on_127_0_0_1(gallery):
    port = _free_port()
    command = [sys.executable, "-m", "sgraf", "serve", "--index", str(gallery["index"]), "--port", str(port),
               "--shortlist", "6"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    try:
        banner = next(line for line in server.stdout if line.startswith("serving ") or not line)
        assert f"at http://127.0.0.1:{port}/" in banner
        deadline, health = time.monotonic() + 60, None
        while health is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=5) as response:
                    health = json.load(response)
            except OSError:
                time.sleep(0.2)
        assert health is not None and health["gallery"]["images"] == N_IMG
        url = f"http://127.0.0.1:{port}/api/search?text=a+red+ball&top_k=3"
        with urllib.request.urlopen(url, timeout=30) as response:
            assert len(json.load(response)["results"]) == 3
        with pytest.raises(urllib.error.HTTPError) as error:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/search?top_k=3", timeout=30)
        assert error.value.code == 400 and "error" in json.load(error.value)
        if Path("/proc/net/tcp").is_file():   # Linux: the listening socket is bound to 127.0.0.1 only
            listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
            listening = [row for row in listening if row[1].endswith(f":{port:04X}") and row[3] == "0A"]
            assert listening and all(row[1].startswith("0100007F:") for row in listening)
    finally:
        server.terminate()
        server.wait(30)


def test_serve_binds_this_machine_only_unless_told():
    from sgraf.cli import build_parser

    args = build_parser().parse_args(["serve", "--index", "x"])
    assert (args.host, args.port) == ("127.0.0.1", 8000)
