import pathlib

import pytest
import torch

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Keep tests reproducible and light on the 2-core CI machines.
    torch.set_num_threads(2)
    yield


@pytest.fixture
def data_dir() -> pathlib.Path:
    return DATA
