import os
import pathlib
import signal
import tempfile

import pytest
import torch

DATA = pathlib.Path(__file__).parent / "data"


def pytest_configure(config):
    config.addinivalue_line("markers", "numeric: compares float results (run under every kernel setting by "
                                       "scripts/numerics-matrix)")
    # measured choices (sgraf.kernels.tuning) go to a folder of this run, not the user's cache
    os.environ.setdefault("SGRAF_CACHE_DIR", tempfile.mkdtemp(prefix="sgraf-test-cache-"))


def threads_per_test() -> int:
    """Torch threads each test starts with: `SGRAF_TEST_THREADS` where set (another count, for the
    kernel matrix), else 2 (reproducible and light on the 2-core CI machines), or fewer when
    pytest-xdist's workers (`pytest -n N`) would otherwise share the cores out more than once:
    one each with two workers on two cores. Tests of paths that need several threads set them."""
    if "SGRAF_TEST_THREADS" in os.environ:
        return int(os.environ["SGRAF_TEST_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, cores // workers))


@pytest.fixture(autouse=True)
def _process_state():
    """Each test starts with the same process-wide state and leaves it as it found it, however the
    suite was started (from a terminal, or in the background where SIGINT is inherited ignored):
    torch threads, SIGINT/SIGTERM handlers, umask, working folder and environment."""
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_test())
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    umask = os.umask(0o022)
    os.umask(umask)
    cwd = os.getcwd()
    environ = dict(os.environ)
    yield
    torch.set_num_threads(threads)
    for signum, handler in handlers.items():
        if handler is not None:   # None: set outside Python, cannot be put back
            signal.signal(signum, handler)
    os.umask(umask)
    os.chdir(cwd)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)


@pytest.fixture
def python_sigint():
    """SIGINT raises KeyboardInterrupt in the test, as in a terminal (a suite started in the
    background inherits SIGINT ignored); the handler found is put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch):
    """A fresh store of measured choices (`sgraf.kernels.tuning`), none remembered in this
    process, tuning on and no route forced (restored after): the store's path."""
    from sgraf.kernels import tuning

    monkeypatch.setenv("SGRAF_CACHE_DIR", str(tmp_path))
    for variable in ("SGRAF_TUNE", "SGRAF_EDGE_ROUTE", "SGRAF_WORD_ROUTE", "SGRAF_STEP_ROUTE", "SGRAF_ATTENTION_ROUTE",
                     "SGRAF_FILTER_ROUTE"):
        monkeypatch.delenv(variable, raising=False)
    tuning.forget()
    yield tmp_path / "tuning.json"
    tuning.forget()


@pytest.fixture
def data_dir() -> pathlib.Path:
    return DATA
