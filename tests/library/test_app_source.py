"""A node that runs another app's copy of the run's package is recognized at the hello, and the error says why."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from flower_dlion import DLionClient
from flower_dlion.clients.app_source import foreign_code
from flower_dlion.protocol import HELLO, ClientStateError

MODEL = "import torch\n\n\nclass Net(torch.nn.Linear):\n    def __init__(self):\n        super().__init__(4, {out})\n"


@pytest.fixture
def two_copies(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """Package ``name`` (with ``name.model``) in two folders: imported from the first, the second first on sys.path."""
    name = f"app_{uuid.uuid4().hex[:8]}"
    elsewhere, run_dir = tmp_path / "elsewhere", tmp_path / "run"
    for root in (elsewhere, run_dir):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
    (elsewhere / name / "model.py").write_text(MODEL.format(out=3))
    sys.path.insert(0, str(elsewhere))
    importlib.import_module(f"{name}.model")  # what an editable install or a long-lived process gave
    sys.path.remove(str(elsewhere))
    sys.path.insert(0, str(run_dir))  # what Flower does before it loads the run's ClientApp
    try:
        yield name, elsewhere, run_dir
    finally:
        sys.path.remove(str(run_dir))
        for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
            del sys.modules[module]


def test_another_copy_of_the_package_is_foreign_the_same_files_are_not(two_copies: tuple[str, Path, Path]) -> None:
    # Prepare: the run's own model.py differs from the one imported
    name, elsewhere, run_dir = two_copies
    net = sys.modules[f"{name}.model"].Net
    (run_dir / name / "model.py").write_text(MODEL.format(out=5))
    # Execute
    why = foreign_code(net)
    # Assert: both files named; the same bytes under the run's folder (e.g. an editable install of this
    # very app) pass; a class of this repository's own packages passes
    assert why == (
        f"its model's module {name}.model was loaded from {elsewhere / name / 'model.py'}, "
        f"but this run's app holds {run_dir / name / 'model.py'}"
    )
    (run_dir / name / "model.py").write_text(MODEL.format(out=3))
    assert foreign_code(net) is None
    from ..models import Net  # the tests' own CNN

    assert foreign_code(Net) is None


def test_a_dlionclient_running_another_apps_model_refuses_the_hello(two_copies: tuple[str, Path, Path]) -> None:
    # Prepare: the run's app has no model.py of its own (the imported one is another app's)
    name, _, _ = two_copies
    client = DLionClient(ClientApp(), sys.modules[f"{name}.model"].Net)
    context = Context(run_id=1, node_id=9, node_config={}, state=RecordDict(), run_config={})
    hello = Message(RecordDict({HELLO: ConfigRecord({"state-key": "k"})}), dst_node_id=9, message_type="query.dlion")
    # Execute / Assert: refused, naming the node, the files and the likely causes
    with pytest.raises(ClientStateError, match=r"node 9: this node runs another app's code \(its model's module") as e:
        client.hello(hello, context)
    assert "a local SuperLink left running by an earlier `flwr run`" in str(e.value)
    assert "an editable install of another app with the same package name" in str(e.value)
