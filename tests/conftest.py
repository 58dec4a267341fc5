import os
import pathlib
import tempfile

import pytest
import torch

DATA = pathlib.Path(__file__).parent / "data"


def pytest_configure(config):
    config.addinivalue_line("markers", "numeric: compares float results (run under every kernel setting by "
                                       "scripts/numerics-matrix)")
    # measured choices (sgraf.kernels.tuning) go to a folder of this run, not the user's cache
    os.environ.setdefault("SGRAF_CACHE_DIR", tempfile.mkdtemp(prefix="sgraf-test-cache-"))


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Keep tests reproducible and light on the 2-core CI machines (SGRAF_TEST_THREADS: another count,
    # for the kernel matrix).
    torch.set_num_threads(int(os.environ.get("SGRAF_TEST_THREADS", "2")))
    yield


@pytest.fixture
def data_dir() -> pathlib.Path:
    return DATA
