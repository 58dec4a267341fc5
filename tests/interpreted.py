"""The Triton kernels' CPU tests: a script run through Triton's interpreter, in a process of its
own (`TRITON_INTERPRET=1` must be set before Triton is imported)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from sgraf import torch_compat

TESTS = str(pathlib.Path(__file__).parent)     # for a script's `sys.path` (the tests' helpers)
needs_triton = pytest.mark.skipif(not torch_compat.triton_usable(),
                                  reason="needs Triton 3.4 or later (pip install 'triton>=3.4')")


def interpreted(script: str, *args: str) -> Any:
    """The JSON value `script` prints last, run with `args` under Triton's interpreter; the test
    fails with the script's error output if it fails."""
    completed = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                               env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])
