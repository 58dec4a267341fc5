"""`sgraf serve` under requests that cost too much, clients that leave, signals, bad addresses and
other data: the bounds of issue 22, each case asserting the answer or the message."""

from __future__ import annotations

import http.client
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from sgraf.api import MAX_TEXT_CHARS, MAX_TEXT_WORDS  # noqa: E402
from sgraf.cli import build_parser, main  # noqa: E402
from sgraf.errors import InputError  # noqa: E402
from sgraf.serve.app import create_app  # noqa: E402
from sgraf.serve.service import SearchService  # noqa: E402
from sgraf.serve.worker import ShuttingDown, Worker  # noqa: E402
from test_serve import N_IMG, SRC, _block, _free_port, gallery, service  # noqa: E402,F401  (fixtures)

LONG_WORDS = " ".join(["a"] * (MAX_TEXT_WORDS + 1))        # 65 words in 129 characters
LONG_CHARS = "a" * (MAX_TEXT_CHARS + 1)


@pytest.fixture(scope="module")
def client(service):
    with TestClient(create_app(service), raise_server_exceptions=False) as client:
        yield client


# --------------------------------------------------------------------------------- text limit
@pytest.mark.parametrize("route", ["/api/search", "/api/explain", "/api/explain.png"])
@pytest.mark.parametrize("text, message", [
    (LONG_WORDS, f"text is too long: {MAX_TEXT_WORDS + 1} words, the limit is {MAX_TEXT_WORDS}"),
    (LONG_CHARS, f"text is too long: {MAX_TEXT_CHARS + 1} characters, the limit is {MAX_TEXT_CHARS}"),
])
def test_every_route_refuses_a_text_over_the_one_limit(client, route, text, message):
    response = client.get(route, params={"text": text, "image_id": 0} if "explain" in route else {"text": text})
    assert response.status_code == 400 and response.json() == {"error": message}


def test_sgraf_search_text_has_the_same_limit(gallery, capsys):
    assert main(["search", "--index", str(gallery["index"]), "--text", LONG_WORDS]) == 2
    assert capsys.readouterr().err == (f"sgraf search: error: text is too long: {MAX_TEXT_WORDS + 1} words, "
                                       f"the limit is {MAX_TEXT_WORDS}\n")
    assert main(["search", "--index", str(gallery["index"]), "--text", " ".join(["a"] * MAX_TEXT_WORDS)]) == 0
    capsys.readouterr()
    main(["search", "--help"])
    assert f"at most {MAX_TEXT_CHARS} characters and {MAX_TEXT_WORDS} words" in " ".join(capsys.readouterr().out.split())


def test_the_explanation_picture_of_the_longest_text_stays_small(client):
    longest = " ".join(["a"] * MAX_TEXT_WORDS)                       # 64 words: a panel each
    response = client.get("/api/explain.png", params={"image_id": 1, "text": longest})
    assert response.status_code == 200
    width, height = Image.open(io.BytesIO(response.content)).size
    assert width <= 1000 and height <= 2000, (width, height)
    one_long_word = "dog " + "z" * 400                                 # an unknown word of 400 characters
    response = client.get("/api/explain.png", params={"image_id": 1, "text": one_long_word, "allow_unknown": "true"})
    assert response.status_code == 200
    assert Image.open(io.BytesIO(response.content)).size[0] <= 1000


# --------------------------------------------------------------------------------- pictures, paths
def test_a_long_picture_name_or_a_link_loop_is_404_without_a_traceback(client, gallery, caplog):
    folder = gallery["data"] / "images" / "test"
    if not (folder / "loop-a.png").is_symlink():
        (folder / "loop-a.png").symlink_to(folder / "loop-b.png")
        (folder / "loop-b.png").symlink_to(folder / "loop-a.png")
    with caplog.at_level(logging.DEBUG):
        for path in ("/images/" + "p" * 300 + ".png", "/images/loop-a.png", "/images/" + "d" * 300 + "/x.png"):
            response = client.get(path)
            assert response.status_code == 404 and list(response.json()) == ["error"], path
            assert response.json()["error"].startswith("no picture '")
    assert not [record for record in caplog.records if record.exc_info]


def test_no_answer_shows_an_absolute_path(gallery, tmp_path):
    copy = tmp_path / "index"
    shutil.copytree(gallery["index"], copy)
    data = tmp_path / "data"                                   # pictures, but no features: no explanations
    shutil.copytree(gallery["data"] / "images", data / "images", symlinks=True)
    opened = SearchService.open(copy, data_dir=data, shortlist=6)
    roots = {str(tmp_path), str(tmp_path.resolve()), str(gallery["root"]), str(gallery["root"].resolve())}
    with TestClient(create_app(opened), raise_server_exceptions=False) as client:
        health = client.get("/api/health").json()
        assert health["index"] == "index"
        assert [m["source"] for m in health["models"]] == [os.path.relpath(Path(p).resolve(), copy.resolve())
                                                          for p in gallery["paths"]]
        answers = [client.get("/api/health"), client.get("/api/explain", params={"image_id": 0, "text": "a dog"}),
                   client.get("/images/nothing.png"), client.get("/api/search", params={"text": "a zebra"})]
        assert answers[1].status_code == 404 and "test_ims.npy" in answers[1].json()["error"]
        for answer in answers:
            assert not any(root in answer.text for root in roots), answer.text


def test_public_messages_make_server_paths_relative(service, gallery):
    data = gallery["data"].resolve()
    assert service.public(f"{data}/test_ims.npy: bad") == "../data/test_ims.npy: bad"
    assert service.public("cannot read '/etc/secret/file.npy' now") == "cannot read 'file.npy' now"
    # Windows' paths (a drive, a share) are cut to their file names too
    assert service.public("C:\\Users\\me\\secret\\x.npy: bad") == "x.npy: bad"
    assert service.public("read \\\\server\\share\\y.npy now") == "read y.npy now"


def test_an_answer_echoes_the_clients_own_text_as_sent(client, service, gallery):
    """Paths in a query had been rewritten in the echo (`red /x/y/index` came back as `red index`,
    and the server's own folders as `.` or `../data`): words the user never typed, and an oracle
    for the server's paths."""
    index_root = str(gallery["root"].resolve() / "index")
    for text in ("a /tmp/guess/Zebra", f"a {index_root}", f"a {gallery['data'].resolve()}", "C:\\x\\y",
                 "a C:\\Users\\me\\Zebra"):      # a backslash, which the quoted echo doubles
        answer = client.get("/api/search", params={"text": text})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error.startswith(f"query {text!r}"), error
        assert "\\" in text or text.split()[1].lower() in error, error
    # the server's own paths in its messages stay hidden, also from a client whose word starts them
    assert service.public(f"{index_root}/manifest.json: gone", keep=["a dog"]) == "./manifest.json: gone"
    assert service.public(f"{index_root}/manifest.json: gone", keep=[index_root[:5]]) == "./manifest.json: gone"


# --------------------------------------------------------------------------------- headers
def test_security_and_cache_headers(client):
    for path in ("/", "/docs", "/static/app.js", "/images/00000.png", "/api/health", "/api/nothing",
                 "/api/search?text=a+dog"):
        response = client.get(path)
        assert response.headers["x-content-type-options"] == "nosniff", path
        assert "default-src 'none'" in response.headers["content-security-policy"], path
        assert (response.headers.get("cache-control") == "no-store") == path.startswith("/api/"), path
    policy = client.get("/").headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe" not in policy


# --------------------------------------------------------------------------------- the queue
def test_a_cancelled_job_leaves_the_queue_and_never_runs(service):
    ran = []
    with Worker(service, max_queue=2) as worker:
        release = _block(worker)
        try:
            gone = worker.call(ran.append, "gone", heavy=True)
            kept = worker.call(ran.append, "kept")
            assert worker.waiting == 2
            assert gone.cancel() and worker.waiting == 1 and worker.dropped == 1
            worker.call(ran.append, "in its place")                 # the freed place takes another job
        finally:
            release.set()
        kept.result(10)
    assert ran == ["kept", "in its place"]


def test_searches_and_explanations_alternate(service):
    order = []
    with Worker(service, max_queue=16) as worker:
        release = _block(worker)
        try:
            futures = [worker.call(order.append, f"explain {i}", heavy=True) for i in range(3)]
            futures += [worker.call(order.append, f"search {i}") for i in range(3)]
        finally:
            release.set()
        for future in futures:
            future.result(10)
    # the blocking job was a search, so an explanation goes next; then one of each in turn
    assert order == ["explain 0", "search 0", "explain 1", "search 1", "explain 2", "search 2"]


def test_clients_take_turns_in_the_queue(service):
    """A client that queued many requests delays another client's next one by one of its own, not by
    all of them: each client waits in a line of its own and the lines take turns (before, the queue
    ran in arrival order: "b 0" ran sixth, after all five of a's)."""
    order = []
    with Worker(service, max_queue=32) as worker:
        release = _block(worker)
        try:
            futures = [worker.call(order.append, f"a {i}", heavy=True, client="a") for i in range(5)]
            futures += [worker.call(order.append, f"b {i}", heavy=True, client="b") for i in range(2)]
            futures += [worker.call(order.append, "c 0", heavy=True, client="c")]
        finally:
            release.set()
        for future in futures:
            future.result(10)
    assert order == ["a 0", "b 0", "c 0", "a 1", "b 1", "a 2", "a 3", "a 4"]


def test_a_batch_of_text_searches_takes_each_clients_first_before_anyones_second(service):
    """With more searches waiting than a batch holds, the batch takes them in the clients' turns:
    a's 6 searches and b's one, batches of 4: b's rides in the first batch (before, the second)."""
    batches = []
    with Worker(service, max_queue=32, max_batch=4) as worker:
        real = worker.service.search_texts
        worker.service = type("Recording", (), {
            "matcher": service.matcher,
            "search_texts": lambda self, texts, *args: batches.append(list(texts)) or real(texts, *args)})()
        release = _block(worker)
        try:
            futures = [worker.search_text(f"a dog {i}", 3, 6, client="a") for i in range(6)]
            futures.append(worker.search_text("a cat", 3, 6, client="b"))
        finally:
            release.set()
        for future in futures:
            future.result(30)
    assert batches == [["a dog 0", "a cat", "a dog 1", "a dog 2"], ["a dog 3", "a dog 4", "a dog 5"]]


def test_one_client_holds_at_most_its_share_of_the_queue(service):
    """A client with `max_per_client` requests waiting is answered 429 for more, with Retry-After;
    another client still gets a place (before, the first client filled all 8 places and the other
    was answered 503)."""
    with TestClient(create_app(service, max_queue=8, max_batch=4)) as client:
        worker = client.app.state.worker
        assert worker.max_per_client == 2                                    # a quarter of the queue
        release = _block(worker)
        try:
            mine = [worker.call(lambda: None, client="testclient") for _ in range(2)]
            response = client.get("/api/search", params={"text": "a dog"})  # TestClient's address
            assert response.status_code == 429 and response.headers["Retry-After"] == "1"
            assert response.json()["error"] == ("too many requests: this client has 2 requests waiting (the limit "
                                                "per client); retry once they are answered")
            other = worker.search_text("a dog", 3, 6, client="198.51.100.7")    # another address: a place
            unknown = [worker.call(lambda: None) for _ in range(3)]              # no address: no limit of its own
            assert worker.waiting == 6 and worker.client_busy == 1
        finally:
            release.set()
        for future in [*mine, other, *unknown]:
            future.result(30)
        queue = client.get("/api/health").json()["queue"]
        assert queue["max_per_client"] == 2 and queue["client_busy"] == 1
    with TestClient(create_app(service, max_queue=8, max_per_client=20)) as client:
        assert client.app.state.worker.max_per_client == 8                   # never more than the queue


def test_close_refuses_the_queued_jobs_and_lets_the_one_in_hand_finish(service):
    worker = Worker(service, max_queue=8).start()
    release = _block(worker)
    in_hand = worker._threads[0]
    queued = [worker.call(lambda: "ran") for _ in range(5)]
    assert worker.close() == 5
    for future in queued:
        with pytest.raises(ShuttingDown, match="shutting down"):
            future.result(1)
    with pytest.raises(ShuttingDown, match="this request was not run; retry on the restarted server$"):
        worker.call(lambda: None)
    release.set()
    in_hand.join(10)
    assert not in_hand.is_alive() and worker.refused == 6


def test_computing_says_a_thread_outlived_stop(service):
    worker = Worker(service).start()
    release = _block(worker)
    worker.stop(timeout=0.1)               # the blocked job outlives the stop: `sgraf serve` exits at once then
    assert worker.computing
    release.set()
    deadline = time.monotonic() + 10
    while worker.computing and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not worker.computing


def _uvicorn_server(app, **config):
    """uvicorn serving `app` on a free port in a thread (`config`: more of uvicorn.Config's options)."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    return server, thread, port


def test_a_client_that_disconnects_takes_its_queued_job_with_it(service):
    explained = []
    counted = SearchService.__new__(SearchService)
    counted.__dict__.update(service.__dict__)
    counted.explain = lambda *args, **kwargs: explained.append(args) or service.explain(*args, **kwargs)
    app = create_app(counted)
    server, thread, port = _uvicorn_server(app)
    worker = app.state.worker
    try:
        release = _block(worker)
        try:
            leaving = socket.create_connection(("127.0.0.1", port))
            leaving.sendall(b"GET /api/explain?image_id=1&text=a+dog HTTP/1.1\r\nHost: x\r\n\r\n")
            deadline = time.monotonic() + 10
            while worker.waiting < 1 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert worker.waiting == 1
            leaving.close()
            while worker.waiting and time.monotonic() < deadline:
                time.sleep(0.02)
            assert (worker.waiting, worker.dropped) == (0, 1)
        finally:
            release.set()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", "/api/explain?image_id=2&text=a+cat")
        assert connection.getresponse().status == 200
        connection.close()
        assert [args[0] for args in explained] == [2]           # the one whose client left never ran
    finally:
        server.should_exit = True
        thread.join(30)


# --------------------------------------------------------------------------------- the command
def test_serve_shortlist_0_scores_the_whole_gallery_as_search_does(gallery, service, capsys):
    assert build_parser().parse_args(["serve", "--index", "x", "--shortlist", "0"]).shortlist == 0
    whole = SearchService(service.index, shortlist=0)
    assert whole.shortlist_for(3) is None
    answer = whole.search_text("a red ball", top_k=N_IMG)["results"]
    expected = service.index.search_text("a red ball", top_k=N_IMG, shortlist=None)
    assert [(r["id"], r["score"]) for r in answer] == [(h.id, h.score) for h in expected]
    assert main(["search", "--index", str(gallery["index"]), "--text", "a red ball", "--shortlist", "0",
                 "--top-k", str(N_IMG), "--json"]) == 0
    assert [hit["id"] for hit in json.loads(capsys.readouterr().out)] == [r["id"] for r in answer]


def test_a_busy_port_or_a_bad_host_is_one_line_before_serving(gallery, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--index", str(gallery["index"]), "--port", str(port)]) == 2
        out, err = capsys.readouterr()
        # said before the index and the models load (seconds): not the missing index's error
        assert main(["serve", "--index", "no-such-index", "--port", str(port)]) == 2
        assert "the port is already in use" in capsys.readouterr().err
    assert "serving" not in out
    assert err == (f"sgraf serve: error: --port {port}: the port is already in use on 127.0.0.1 (another "
                   "server?); choose another --port\n")
    assert main(["serve", "--index", str(gallery["index"]), "--host", "no-such-host.invalid", "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert "serving" not in out and err.startswith("sgraf serve: error: --host no-such-host.invalid: not an address")
    assert err.count("\n") == 1
    assert main(["serve", "--index", str(gallery["index"]), "--host", "192.0.2.1", "--port", "0"]) == 2
    assert "--host 192.0.2.1: not an address of this machine" in capsys.readouterr().err


def _start_serve(gallery, ignore_sigint: bool = False) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    command = [sys.executable, "-m", "sgraf", "serve", "--index", str(gallery["index"]), "--port", str(port),
               "--shortlist", "6", "--max-queue", "64"]
    if ignore_sigint:      # as a job started in the background by a shell script
        command = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.executable, sys.argv[1:])", *command]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              # no route measured: its INFO line on stderr had depended on the tests run before
                              env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "SGRAF_TUNE": "off"})
    banner = server.stdout.readline()
    assert f"at http://127.0.0.1:{port}/" in banner, (banner, server.stderr.read() if server.poll() else "")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:     # an answer, not only a connection: uvicorn has its signal handlers
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/api/health")
            if connection.getresponse().status == 200:
                connection.close()
                return server, port
        except (OSError, http.client.HTTPException):
            time.sleep(0.1)
    raise AssertionError("the server did not answer")


def test_sigterm_with_jobs_queued_refuses_them_and_exits_143_at_once(gallery):
    server, port = _start_serve(gallery)
    statuses: list[object] = []

    def explain(i: int) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            connection.request("GET", f"/api/explain.png?image_id={i % N_IMG}&text=" + "+".join(["a"] * 60))
            response = connection.getresponse()
            statuses.append((response.status, response.read()))
        except (OSError, http.client.HTTPException) as error:
            statuses.append(error)
        finally:
            connection.close()

    try:
        clients = [threading.Thread(target=explain, args=(i,)) for i in range(20)]
        for client in clients:
            client.start()
        time.sleep(1.5)                                         # the first explanations are running
        tic = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(30)
        took = time.monotonic() - tic
        for client in clients:
            client.join(30)
    finally:
        if server.poll() is None:
            server.kill()
    stderr = server.stderr.read()
    assert code == 143 and stderr.strip().splitlines()[-1] == "sgraf serve: stopped by SIGTERM", stderr
    assert took < 10, (took, stderr, [s if not isinstance(s, tuple) else (s[0], s[1][:60]) for s in statuses])
    refused = [s for s in statuses if isinstance(s, tuple) and s[0] == 503]
    assert refused and all(b"the server is shutting down" in body for _, body in refused)
    assert "Traceback" not in stderr


@pytest.mark.parametrize("ignored", [False, True], ids=["sigint-default", "sigint-ignored-by-the-parent"])
def test_ctrl_c_exits_130_with_one_line(gallery, ignored):
    server, _ = _start_serve(gallery, ignore_sigint=ignored)
    try:
        server.send_signal(signal.SIGINT)
        code = server.wait(30)
    finally:
        if server.poll() is None:
            server.kill()
    assert (code, server.stderr.read()) == (130, "sgraf serve: interrupted\n")


# --------------------------------------------------------------------------------- other data
def test_serve_refuses_other_data_of_the_same_shape_naming_both(gallery, tmp_path, monkeypatch):
    manifest = json.loads((gallery["index"] / "manifest.json").read_text())
    assert set(manifest["source"]["data_fingerprint"]) == {"test_ims.npy", "test_caps.txt"}
    other = tmp_path / "other"
    shutil.copytree(gallery["data"], other, symlinks=True)
    features = np.load(other / "test_ims.npy")
    np.save(other / "test_ims.npy", features[::-1].copy())                  # same shape, other images
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError) as error:
        SearchService.open(gallery["index"], data_dir="other")
    message = str(error.value)
    assert message.startswith("--data other is not the data the index"), message      # as given
    assert str(gallery["data"].resolve()) in message and "test_ims.npy differ" in message
    moved = tmp_path / "moved"
    shutil.copytree(gallery["data"], moved, symlinks=True)
    assert SearchService.open(gallery["index"], data_dir=moved).features is not None   # the same data, moved


def test_serve_refuses_another_splits_pictures_in_the_gallerys_folder(gallery, tmp_path):
    """Another split's pictures copied over the gallery's had been served as its own, health "ok"."""
    manifest = json.loads((gallery["index"] / "manifest.json").read_text())
    assert manifest["source"]["pictures"]["count"] == 12
    other = tmp_path / "other"
    shutil.copytree(gallery["data"], other, symlinks=True)
    pictures = other / "images" / "test"
    (pictures / "extra-notes.png").write_bytes(b"not of the gallery")     # other files count for nothing
    assert SearchService.open(gallery["index"], data_dir=other).picture_dir == pictures.resolve()
    (pictures / "00003.png").write_bytes((pictures / "00003.png").read_bytes() + b"\0" * 7)   # another picture
    with pytest.raises(InputError, match=r"the pictures of .*other/images/test are not those the index .* was built "
                                         r"with \(other sizes or names\): give the data it was built from"):
        SearchService.open(gallery["index"], data_dir=other)
    (pictures / "00003.png").unlink()
    with pytest.raises(InputError, match=r"\(12 pictures then, 11 now\)"):
        SearchService.open(gallery["index"], data_dir=other)


def test_serve_refuses_region_boxes_other_than_the_index_was_built_with(gallery, tmp_path):
    """Explanations draw the data's boxes: boxes changed since the index was built had been drawn
    over the pictures, neither checked at start nor watched while serving."""
    data = tmp_path / "data"
    shutil.copytree(gallery["data"], data, symlinks=True)
    boxes = np.tile(np.array([0.0, 0.0, 12.0, 12.0], np.float32), (N_IMG, 9, 1))
    np.save(data / "test_boxes.npy", boxes)
    index = tmp_path / "index"
    assert main(["index", "--checkpoint", gallery["paths"][0], "--data", str(data), "--split", "test",
                 "--out", str(index), "--quiet"]) == 0
    manifest = json.loads((index / "manifest.json").read_text())
    assert "test_boxes.npy" in manifest["source"]["data_fingerprint"]
    opened = SearchService.open(index)
    assert "test_boxes.npy" in opened._data_files
    opened._data_digests.result()                                     # the started files hashed
    boxes[2, 0] = [1, 1, 5, 5]
    np.save(data / "test_boxes.npy", boxes)
    os.utime(data / "test_boxes.npy", ns=(7, 7))                     # written later than the server started
    assert opened.data_changed() == ["test_boxes.npy"]                # watched while serving
    with pytest.raises(InputError, match=r"the files of .* changed since the index .* \(test_boxes\.npy differ\)"):
        SearchService.open(index)
    # an index that recorded no boxes (built before they were recorded) is served with them
    del manifest["source"]["data_fingerprint"]["test_boxes.npy"]
    (index / "manifest.json").write_text(json.dumps(manifest))
    assert SearchService.open(index, verify=False).features is not None


# --------------------------------------------------------------------------------- batches
def test_a_text_scores_the_same_bits_in_any_batch(service):
    rng = np.random.default_rng(3)
    words = "a dog cat runs on the grass man woman red blue ball plays with in park".split()
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 12)))) for _ in range(40)]
    alone = [service.index.search_texts([text], top_k=5, shortlist=6)[0] for text in texts]
    together = service.index.search_texts(texts, top_k=5, shortlist=6)         # 40: groups of 16, 16, 8
    for solo, batched in zip(alone, together):
        assert [(h.id, h.score, h.coarse) for h in batched] == [(h.id, h.score, h.coarse) for h in solo]
    with Worker(service, max_queue=64, max_batch=16) as worker:
        release = _block(worker)
        futures = [worker.search_text(text, 5, 6) for text in texts]
        release.set()
        served = [future.result(30) for future in futures]
    assert worker.batches < len(texts)
    for solo, answer in zip(alone, served):
        assert [(r["id"], r["score"]) for r in answer] == [(h.id, h.score) for h in solo]
