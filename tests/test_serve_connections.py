"""`sgraf serve` against slow or hostile clients and files changed under it: the header deadline,
the connection cap, malformed requests answered in JSON, an index held in memory, data that
changed while serving (a serving walk found each of these)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed")
from fastapi.testclient import TestClient  # noqa: E402

from sgraf.serve.app import SECURITY_HEADERS, create_app  # noqa: E402
from sgraf.serve.connections import connection_cap, guarded_protocol, raise_descriptor_limit  # noqa: E402
from sgraf.serve.service import SearchService  # noqa: E402
from test_serve import gallery, service  # noqa: E402,F401  (fixtures)
from test_serve_limits import _uvicorn_server  # noqa: E402

TIMEOUT_S = 0.6
WRITE_TIMEOUT_S = 1.0
CAP = 4


@pytest.fixture(scope="module")
def guarded(service):
    """A uvicorn server over the app with the guarded protocol: 4 connections, 0.6 s for headers."""
    server, thread, port = _uvicorn_server(create_app(service), http=guarded_protocol(
        SECURITY_HEADERS, cap=CAP, header_timeout=TIMEOUT_S, write_timeout=WRITE_TIMEOUT_S))
    yield port
    server.should_exit = True
    thread.join(30)


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes `sock` within `within` seconds (reads until end of stream)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def _health(port: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", "/api/health")
    status = connection.getresponse().status
    connection.close()
    return status


def test_a_client_that_sends_half_a_request_or_nothing_is_disconnected(guarded):
    half = socket.create_connection(("127.0.0.1", guarded))
    half.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\n")           # no blank line: headers never end
    silent = socket.create_connection(("127.0.0.1", guarded))
    started = time.monotonic()
    assert _closed_by_server(half, 10) and _closed_by_server(silent, 10)
    assert TIMEOUT_S * 0.8 <= time.monotonic() - started < 8
    assert _health(guarded) == 200


def test_a_kept_alive_connection_gets_the_deadline_for_its_next_request(guarded):
    connection = socket.create_connection(("127.0.0.1", guarded))
    connection.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n")
    connection.settimeout(10)
    assert connection.recv(65536).startswith(b"HTTP/1.1 200")
    connection.sendall(b"GET /api/health HTTP/1.1\r\n")                  # the next request, stalled
    assert _closed_by_server(connection, 4)                              # before uvicorn's 5 s keep-alive


def test_a_body_sent_a_byte_at_a_time_does_not_hold_the_connection(guarded):
    """After whole headers a client that trickles a declared body had kept its connection open
    for as long as it liked (each byte put off uvicorn's keep-alive timeout)."""
    sock = socket.create_connection(("127.0.0.1", guarded))
    sock.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
    started = time.monotonic()
    sock.settimeout(0.2)
    closed = False
    while time.monotonic() - started < 10 and not closed:
        try:
            sock.sendall(b"x")
            while sock.recv(65536):
                pass
            closed = True
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            closed = True
    assert closed and time.monotonic() - started < 5


def test_a_client_that_reads_no_answer_is_disconnected(guarded):
    """Requests sent one after the other whose answers are never read: the answers fill the send
    buffers and wait; the connection had been held without end (and enough of them held every
    place). It is dropped once its buffer has not drained for the write deadline."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", guarded))
    sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 400)
    time.sleep(WRITE_TIMEOUT_S + 3)                # read nothing meanwhile
    sock.settimeout(10)
    received, start = 0, time.monotonic()
    try:
        while chunk := sock.recv(1 << 16):         # what the kernel held, then the end of the stream
            received += len(chunk)
    except ConnectionResetError:
        pass
    sock.close()
    assert time.monotonic() - start < 8, "the connection was not closed"
    single = len(json.dumps(json.loads(_get(guarded, "/openapi.json"))))
    assert received < 400 * single / 2, (received, single)      # most answers were never sent
    assert _health(guarded) == 200


def _get(port: int, path: str) -> bytes:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("GET", path)
    body = connection.getresponse().read()
    connection.close()
    return body


def test_without_a_descriptor_limit_the_cap_is_the_most(monkeypatch):
    from sgraf.serve import connections

    monkeypatch.setattr(connections, "resource", None)                 # as on Windows
    assert connections.connection_cap() == connections.MAX_CONNECTIONS
    assert connections.raise_descriptor_limit() == 0


def test_connections_past_the_cap_are_closed_and_served_again_once_the_stalled_ones_go(guarded):
    stalled = []
    for _ in range(CAP):
        sock = socket.create_connection(("127.0.0.1", guarded))
        sock.sendall(b"GET /api/health HTTP/1.1\r\n")
        stalled.append(sock)
    time.sleep(0.1)
    extra = socket.create_connection(("127.0.0.1", guarded))
    extra.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n")
    extra.settimeout(TIMEOUT_S * 0.5)
    try:
        answer = extra.recv(100)
    except ConnectionResetError:
        answer = b""
    assert answer == b""                                                 # closed, not answered
    assert all(_closed_by_server(sock, 10) for sock in stalled)
    assert _health(guarded) == 200


def test_a_malformed_request_is_answered_in_json_with_the_security_headers(guarded):
    sock = socket.create_connection(("127.0.0.1", guarded))
    sock.sendall(b"GET /api/search?text=a+\xff HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = b""
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    assert lines[0] == "HTTP/1.1 400 Bad Request"
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    assert headers["content-type"] == "application/json"
    assert all(headers[name] == value.lower() for name, value in SECURITY_HEADERS.items())
    assert json.loads(body)["error"].startswith("Invalid HTTP request received")


def test_headers_past_the_limit_are_answered_and_the_connection_closed(guarded):
    """The 400 had left the connection open for the next request of a client that sends too much."""
    sock = socket.create_connection(("127.0.0.1", guarded))
    big = "".join(f"X-Big-{n}: {'a' * 1000}\r\n" for n in range(18))
    sock.sendall(f"GET /api/health HTTP/1.1\r\nHost: x\r\n{big}\r\n".encode())
    sock.settimeout(10)
    first = sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 400 ") and b"connection: close" in first.lower(), first[:300]
    assert _closed_by_server(sock, within=5)
    sock.close()


def test_a_malformed_body_of_a_request_the_app_answers_logs_no_traceback(guarded, caplog):
    """The headers read, the app answering, then a chunk that is not hex: the 400 goes out, and the
    app's own answer is dropped (sending it had raised in h11: two tracebacks per request)."""
    caplog.set_level("WARNING")
    sock = socket.create_connection(("127.0.0.1", guarded))
    sock.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                 b"zz\r\n")
    raw = b""
    sock.settimeout(10)
    while chunk := sock.recv(65536):
        raw += chunk
    assert raw.startswith(b"HTTP/1.1 400 Bad Request")
    time.sleep(0.5)                                      # the app's task ends after the answer
    assert "Traceback" not in caplog.text and "request failed" not in caplog.text, caplog.text
    assert not [record for record in caplog.records if record.exc_info]
    assert _health(guarded) == 200


def test_the_cap_stays_below_the_descriptor_limit():
    import resource

    soft = raise_descriptor_limit()
    assert soft == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert 8 <= connection_cap() <= max(8, (soft - 64) // 2)     # two descriptors a connection


def test_a_limit_the_system_caps_below_its_hard_one_is_raised_as_far_as_it_allows(monkeypatch):
    """macOS refuses a soft limit above OPEN_MAX (10,240) while reporting an unlimited hard one:
    the server had stayed at 256 descriptors (about 80 connections), unsaid."""
    import resource

    from sgraf.serve import connections

    limits = {"soft": 256}

    def setrlimit(_which, pair):
        if pair[0] > connections.MACOS_OPEN_MAX:
            raise ValueError("current limit exceeds maximum limit")
        limits["soft"] = pair[0]

    monkeypatch.setattr(resource, "getrlimit", lambda _which: (limits["soft"], resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    assert raise_descriptor_limit() == connections.MACOS_OPEN_MAX == limits["soft"]


# --------------------------------------------------------------------------------- files changed
def test_an_index_copied_over_while_serving_changes_no_answer_and_health_says_stale(gallery, tmp_path):
    """`cp` over a served index had killed the server (SIGBUS on its memory map) or mixed the
    new embeddings with the old models; the served index is now held in memory."""
    index = tmp_path / "index"
    shutil.copytree(gallery["index"], index)
    opened = SearchService.open(index, shortlist=6, data_dir=gallery["data"])
    with TestClient(create_app(opened)) as client:
        before = client.get("/api/search", params={"text": "a dog runs", "top_k": 5}).json()["results"]
        assert client.get("/api/health").json()["status"] == "ok"
        for name in ("image_regions.0.npy", "caption_words.0.npy", "image_keys.npy"):
            array = np.load(index / name)
            array[...] = 0                      # rewritten in place, as cp does
            with open(index / name, "r+b") as handle:
                handle.seek(-array.nbytes, 2)
                handle.write(array.tobytes())
        (index / "caption_lengths.npy").write_bytes(b"cut short")
        after = client.get("/api/search", params={"text": "a dog runs", "top_k": 5}).json()["results"]
        assert after == before
        health = client.get("/api/health").json()
        assert health["status"] == "stale"
        assert set(health["changed"]) == {"index image_regions.0.npy", "index caption_words.0.npy",
                                          "index image_keys.npy", "index caption_lengths.npy"}


def test_memory_map_keeps_the_index_mapped(gallery):
    held = SearchService.open(gallery["index"], shortlist=6)
    mapped = SearchService.open(gallery["index"], shortlist=6, memory_map=True)
    assert not isinstance(held.index.image_regions[0], np.memmap)
    assert isinstance(mapped.index.image_regions[0], np.memmap)
    assert mapped.search_text("a dog runs", top_k=5) == held.search_text("a dog runs", top_k=5)


def test_pictures_and_explanations_stop_when_the_data_changes_under_the_server(gallery, tmp_path):
    import os

    data = tmp_path / "data"
    shutil.copytree(gallery["data"], data)
    opened = SearchService.open(gallery["index"], shortlist=6, data_dir=data)
    with TestClient(create_app(opened)) as client:
        assert client.get("/images/00001.png").status_code == 200
        assert client.get("/api/explain", params={"image_id": 1, "text": "a dog"}).status_code == 200
        # touched, the same bytes (`touch`, a copy that keeps them): no change (it had answered 503 until a restart)
        for name in ("test_caps.txt", "test_ims.npy"):
            os.utime(data / name, ns=(1, 1))
        assert client.get("/images/00001.png").status_code == 200
        assert client.get("/api/health").json()["status"] == "ok"
        features = np.load(data / "test_ims.npy")
        np.save(data / "test_ims.npy", features[::-1].copy())             # another data set in its place
        for answer in (client.get("/images/00001.png"), client.get("/api/explain", params={"image_id": 1,
                                                                                          "text": "a dog"})):
            assert answer.status_code == 503
            assert "the data folder's test_ims.npy changed since the server started" in answer.json()["error"]
        assert client.get("/api/search", params={"text": "a dog"}).status_code == 200   # the index is unchanged
        health = client.get("/api/health").json()
        assert (health["status"], health["changed"]) == ("stale", ["data test_ims.npy"])


def test_a_large_features_file_edited_in_place_is_a_change(gallery, tmp_path):
    """Whether a touched file kept its bytes had been judged by the data fingerprint (the size and
    the first and last MiB of the features): a row rewritten in place was no change."""
    from sgraf.search import file_states
    from sgraf.serve.service import _InBackground

    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "test_ims.npy", np.zeros((64, 36, 256), np.float32))       # 2.4 MB
    (data / "test_caps.txt").write_text("a dog\n" * 320)
    opened = SearchService.open(gallery["index"], shortlist=6)
    opened.data_dir, opened.split = data, "test"
    opened._data_files = file_states(data, ["test_ims.npy", "test_caps.txt"])
    opened._data_digests = _InBackground(opened._digests)
    os.utime(data / "test_ims.npy", ns=(1, 1))
    assert opened.data_changed() == []                                        # touched only
    mapped = np.load(data / "test_ims.npy", mmap_mode="r+")
    mapped[32, 0, 0] = 1.0                                                    # the middle, in place
    mapped.flush()
    del mapped
    os.utime(data / "test_ims.npy", ns=(2, 2))
    assert opened.data_changed() == ["test_ims.npy"]


def test_features_cut_short_under_an_explanation_are_a_503_not_a_crash(gallery, tmp_path, monkeypatch):
    """A writer truncating the features between the data check and the read (`np.save` of the
    file in a loop) had killed the server with SIGBUS: the row was read from the memory map."""
    from sgraf.data.arrays import open_npy
    from sgraf.serve.service import Stale

    opened = SearchService.open(gallery["index"], shortlist=6)
    copy = tmp_path / "test_ims.npy"
    shutil.copy(gallery["data"] / "test_ims.npy", copy)
    opened.features = open_npy(copy, "features")
    assert opened.explain(5, "a dog")["image_id"] == 5
    os.truncate(copy, 200)                          # after the check, before the read
    monkeypatch.setattr(opened, "data_changed", lambda: [])
    with pytest.raises(Stale, match="test_ims.npy cannot be read now"):
        opened.explain(5, "a dog")


def test_a_touched_file_found_changed_is_hashed_once_per_state(gallery, tmp_path, monkeypatch):
    """Every health check and picture had hashed a features file rewritten in place again (0.26 s
    each for 221 MB, one after another on the event loop)."""
    from sgraf.search import file_states
    from sgraf.serve import service as service_module
    from sgraf.serve.service import _InBackground

    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "test_ims.npy", np.zeros((8, 36, 16), np.float32))
    (data / "test_caps.txt").write_text("a dog\n" * 40)
    opened = SearchService.open(gallery["index"], shortlist=6)
    opened._data_digests.result()       # the gallery's own digests done: that thread reads the fields set below
    opened.data_dir, opened.split = data, "test"
    opened._data_files = file_states(data, ["test_ims.npy", "test_caps.txt"])
    opened._data_digests = _InBackground(opened._digests)
    opened._data_digests.result()
    hashed = []
    sha256_file = service_module.sha256_file
    monkeypatch.setattr(service_module, "sha256_file",       # slow, as a large file is: checks overlap
                        lambda path: (hashed.append(path.name), time.sleep(0.2), sha256_file(path))[2])
    mapped = np.load(data / "test_ims.npy", mmap_mode="r+")
    mapped[3, 0, 0] = 1.0                           # in place: the same file and size
    mapped.flush()
    del mapped
    os.utime(data / "test_ims.npy", ns=(5, 5))
    for _ in range(3):
        assert opened.data_changed() == ["test_ims.npy"]
    assert hashed == ["test_ims.npy"]
    os.utime(data / "test_ims.npy", ns=(6, 6))      # touched again: judged again
    assert opened.data_changed() == ["test_ims.npy"] and hashed == ["test_ims.npy"] * 2
    # touched with the same bytes, checked by four threads at once: hashed by one, the others wait for it
    import threading

    (data / "test_caps.txt").write_text("a dog\n" * 40)
    os.utime(data / "test_caps.txt", ns=(9, 9))
    hashed.clear()
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(opened.data_changed())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert answers == [["test_ims.npy"]] * 4 and hashed.count("test_caps.txt") == 1, (answers, hashed)


def test_warm_up_changes_no_answer(gallery):
    cold = SearchService.open(gallery["index"], shortlist=6)
    warm = SearchService.open(gallery["index"], shortlist=6)
    captions = warm.index.captions
    warm.index.captions = [" ".join(["dog"] * 80), *captions[1:]]     # longer than a query may be
    warm.warm_up()                                                     # (serve had refused to start)
    warm.index.captions = captions
    for text in ("a dog runs", "the red ball"):
        assert warm.search_text(text, top_k=5) == cold.search_text(text, top_k=5)
    assert warm.search_image(3, top_k=5) == cold.search_image(3, top_k=5)


def test_an_unexpected_error_is_answered_500_and_logged_once(service, caplog):
    """Starlette's outermost handler answered and then re-raised, so uvicorn logged the same
    traceback a second time ("Exception in ASGI application")."""
    broken = SearchService.__new__(SearchService)
    broken.__dict__.update(service.__dict__)

    def health() -> dict:
        raise RuntimeError("a bug")

    broken.health = health
    server, thread, port = _uvicorn_server(create_app(broken))
    try:
        with caplog.at_level("ERROR"):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            connection.request("GET", "/api/health")
            answer = connection.getresponse()
            body = json.loads(answer.read())
            connection.close()
            time.sleep(0.2)
    finally:
        server.should_exit = True
        thread.join(30)
    assert answer.status == 500 and answer.getheader("x-content-type-options") == "nosniff"
    assert body == {"error": "internal error (RuntimeError); the server's log has the details"}
    assert caplog.text.count("RuntimeError: a bug") == 1 and "Exception in ASGI application" not in caplog.text, \
        caplog.text
    assert "request failed: GET /api/health" in caplog.text


def test_a_sparing_warning_counts_every_event_and_says_it_once_a_window(caplog, monkeypatch):
    from sgraf.serve import connections

    clock = {"now": 100.0}
    monkeypatch.setattr(connections.time, "monotonic", lambda: clock["now"])
    say = connections._Sparing("refusing new connections: %d open (%d refused so far)")
    with caplog.at_level("WARNING", logger=connections.logger.name):
        for _ in range(3):
            say(4)
        clock["now"] += connections.WARN_EVERY_S
        say(4)
    assert [r.getMessage() for r in caplog.records] == ["refusing new connections: 4 open (1 refused so far)",
                                                        "refusing new connections: 4 open (4 refused so far)"]
