"""Shared fixtures: Flower's task identity for building messages outside a run."""

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
from flwr.supercore.task_identity import TaskIdentity

from .no_app import block_app, blocked

if blocked():  # FLOWER_DLION_NO_APP=1: the library's tests without the app (tests/no_app.py)
    block_app()

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU tensors (set before its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
# partitions cached by this session only (also in the processes it starts), never a user's old ones
os.environ.setdefault("FLOWER_DLION_CACHE", tempfile.mkdtemp(prefix="flower-dlion-cache-"))


@pytest.fixture(autouse=True)
def restore_threads() -> Iterator[None]:
    """Give back torch's thread count after a test that sets its own (tests of the threaded kernels)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def task_identity() -> None:
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 0
