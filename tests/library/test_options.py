"""The option groups of DistributedLion check themselves, with the constructor's messages, and agree with it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from flower_dlion import DistributedLion, lion
from flower_dlion.strategies.divergence import DivergenceOptions
from flower_dlion.strategies.options import (
    DownlinkOptions,
    LocalOptions,
    Options,
    SecureOptions,
    StepOptions,
    SyncOptions,
    UplinkOptions,
)

GROUPS = {"step": StepOptions, "local": LocalOptions, "uplink": UplinkOptions, "downlink": DownlinkOptions,
          "sync": SyncOptions, "secure": SecureOptions, "divergence": DivergenceOptions}  # fmt: skip


def options_of(**kwargs: Any) -> Options:
    """The Options the constructor's keyword arguments ``kwargs`` make, each group built directly."""
    groups = {}
    for name, cls in GROUPS.items():
        names = {f.name for f in dataclasses.fields(cls)}
        groups[name] = cls(**{k: v for k, v in kwargs.items() if k in names})
    return Options(**groups)


def message(build: Any, **kwargs: Any) -> str:
    with pytest.raises(ValueError) as info:
        build(**kwargs)
    return str(info.value)


# one bad value per case: the group that checks it, the arguments, the start of the message
ALONE = [
    (StepOptions, {"lr": -0.1}, "Invalid learning rate: -0.1"),
    (StepOptions, {"lr": float("nan")}, "Invalid learning rate: nan"),
    (StepOptions, {"weight_decay": -1.0}, "Invalid weight_decay value: -1.0"),
    (StepOptions, {"beta1": 1.0}, "Invalid beta1 parameter: 1.0"),
    (StepOptions, {"beta2": -0.5}, "Invalid beta2 parameter: -0.5"),
    (StepOptions, {"lr_schedule": 0.5}, "lr_schedule must be a function of the server round or None, got 0.5"),
    (LocalOptions, {"local_steps": 0}, "local_steps must be >= 1, got 0"),
    (LocalOptions, {"accumulate": 0}, "accumulate must be >= 1, got 0"),
    (LocalOptions, {"local_optimizer": "adam"}, "local_optimizer must be 'lion' or 'sgd', got 'adam'"),
    (LocalOptions, {"local_lr": 0.1}, "local_lr=0.1 applies to local_optimizer='sgd' only"),
    (LocalOptions, {"local_optimizer": "sgd"}, "local_optimizer='sgd' needs local_lr finite and > 0, got None"),
    (LocalOptions, {"local_optimizer": "sgd", "local_lr": -0.1}, "local_optimizer='sgd' needs local_lr finite"),
    (LocalOptions, {"stale_momentum": "forget"}, "stale_momentum must be 'keep', 'decay' or 'reset', got 'forget'"),
    (LocalOptions, {"local_steps": 4, "local_proximal_mu": -1.0}, "local_proximal_mu must be finite and >= 0"),
    (LocalOptions, {"local_proximal_mu": 0.5}, "local_proximal_mu=0.5 needs local_steps > 1"),
    (UplinkOptions, {"aggregation": "sum"}, "aggregation must be 'vote' or 'mean', got 'sum'"),
    (UplinkOptions, {"upload": "fp16"}, "upload must be one of"),
    (UplinkOptions, {"broadcast_bits": 9}, "broadcast_bits must be in [0, 8] (0: exact), got 9"),
    (UplinkOptions, {"broadcast_bits": 1, "server_momentum": 1.0}, "server_momentum must be in [0, 1) (0: off)"),
    (UplinkOptions, {"server_momentum": 0.9}, "server_momentum=0.9 needs broadcast_bits >= 1"),
    (UplinkOptions, {"upload": "ef-sign", "scale_block": -2}, "scale_block must be >= 0"),
    (UplinkOptions, {"scale_block": 64}, "scale_block=64 needs scales: upload='ef-sign' or broadcast_bits >= 1"),
    (UplinkOptions, {"aggregation": "mean", "upload": "ef-sign"}, "upload='ef-sign' with aggregation='mean' needs"),
    (DownlinkOptions, {"downlink": "zip"}, "downlink must be 'auto', 'anchored' or 'chain', got 'zip'"),
    (DownlinkOptions, {"max_history_bytes": -1}, "max_history_bytes must be >= 0 or None, got -1"),
    (SyncOptions, {"momentum_sync_every": -1}, "momentum_sync_every must be >= 0 (0: never), got -1"),
    (SyncOptions, {"buffer_sync_every": -3}, "buffer_sync_every must be >= 0 (0: never), got -3"),
    (SecureOptions, {"secure_degree": -1}, "secure_degree must be >= 0 (0: every other participant), got -1"),
    (DivergenceOptions, {"divergence_factor": 0.5}, "divergence_factor must be a number > 1 (math.inf: watch for"),
    (DivergenceOptions, {"divergence_rounds": 0}, "divergence_rounds must be an integer >= 1, got 0"),
    (DivergenceOptions, {"stop_on_divergence": "yes"}, "stop_on_divergence must be True or False, got 'yes'"),
]

# checks that take two groups: Options makes them
TOGETHER = [
    (
        {"aggregation": "mean", "local_optimizer": "sgd", "local_lr": 0.1, "upload": "sum"},
        "local_optimizer='sgd' uploads",
    ),
    ({"local_optimizer": "sgd", "local_lr": 0.1, "accumulate": 2}, "local_optimizer='sgd' uploads"),
    ({"lr": 0.1, "weight_decay": 1.0, "local_steps": 10}, "lr * weight_decay * local_steps must be <= 0.5 (got 1.0)"),
    ({"lr_schedule": lion.cosine_decay(5), "downlink": "anchored"}, "downlink='anchored' needs a constant learning"),
    ({"aggregation": "mean", "downlink": "anchored"}, "downlink='anchored' needs integer Δs"),
    ({"anchor_every": 0}, "anchor_every must be >= 1 with anchor_every * local_steps <= 2**20"),
    ({"anchor_every": 1 << 19, "local_steps": 3}, "got 524288 (local_steps=3)"),
    ({"secure": True, "aggregation": "mean", "broadcast_bits": 1}, "secure=True masks the 1-bit sign upload"),
    ({"secure": True, "momentum_sync_every": 3}, "momentum_sync_every=3 would send each client's float32"),
]


@pytest.mark.parametrize(("group", "kwargs", "start"), ALONE)
def test_each_group_refuses_a_bad_value_as_the_constructor_does(group: type, kwargs: dict, start: str) -> None:
    alone = message(group, **kwargs)
    assert alone.startswith(start)
    assert message(DistributedLion, **kwargs) == alone


@pytest.mark.parametrize(("kwargs", "start"), TOGETHER)
def test_options_refuse_a_bad_combination_as_the_constructor_does(kwargs: dict, start: str) -> None:
    together = message(options_of, **kwargs)
    assert start in together
    assert message(DistributedLion, **kwargs) == together


GOOD = [
    {},
    {"aggregation": "mean", "upload": "ef-sign", "broadcast_bits": 1, "scale_block": 4096, "local_steps": 3},
    {"local_optimizer": "sgd", "local_lr": 0.03, "local_steps": 4, "lr": 0.5, "stale_momentum": "decay"},
    {"upload": "sum", "local_steps": 2, "local_proximal_mu": 0.01, "downlink": "chain", "max_history_bytes": 0},
    {"lr_schedule": lion.cosine_decay(10), "broadcast_bits": 2, "server_momentum": 0.9, "init_seed": 7},
    {"momentum_sync_every": 3, "momentum_sync_layers": ["conv"], "buffer_sync_every": 0, "anchor_every": 5},
    {"secure": True, "secure_degree": 4, "min_train_nodes": 3},
    {"divergence_factor": 3.0, "divergence_rounds": 2, "stop_on_divergence": True},
]


@pytest.mark.parametrize("kwargs", GOOD)
def test_constructor_and_options_built_directly_agree(kwargs: dict) -> None:
    strategy = DistributedLion(**kwargs)
    options = options_of(**kwargs)
    assert strategy.options == options
    for name, cls in GROUPS.items():
        for field in dataclasses.fields(cls):
            assert getattr(strategy, field.name) == getattr(getattr(options, name), field.name)


def test_defaults_are_the_constructors() -> None:
    assert DistributedLion().options == Options()


def test_derived_options() -> None:
    assert Options().anchored  # "auto": a vote with exact broadcast at a constant rate
    assert not options_of(aggregation="mean").anchored
    assert not options_of(broadcast_bits=1).anchored
    assert not options_of(lr_schedule=lion.cosine_decay(5)).anchored
    assert not options_of(downlink="chain").anchored
    assert LocalOptions(local_steps=4).lion_steps == 4
    assert LocalOptions(local_steps=4, local_optimizer="sgd", local_lr=0.1).lion_steps == 1
    assert SyncOptions(momentum_sync_layers=["a", "b"]).momentum_sync_layers == ("a", "b")  # type: ignore[arg-type]


def test_options_are_read_only() -> None:
    strategy = DistributedLion()
    with pytest.raises(AttributeError, match=r"lr is read-only \(options.step.lr\)"):
        strategy.lr = 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.options.step.lr = 0.1  # type: ignore[misc]
    with pytest.raises(TypeError):
        StepOptions(0.1)  # type: ignore[misc]  # keyword-only, as the constructor
    assert strategy.lr == 2e-3
