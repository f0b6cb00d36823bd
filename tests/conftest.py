"""Shared fixtures: Flower's task identity for building messages outside a run."""

import os

import pytest
from flwr.supercore.task_identity import TaskIdentity

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")


@pytest.fixture(autouse=True)
def task_identity() -> None:
    TaskIdentity.run_id = 1
    TaskIdentity.node_id = 1
    TaskIdentity.task_id = 0
