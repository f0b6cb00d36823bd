"""Issue 50: one typed round config and one typed reply-metrics record, written by one side and read by the other.

``RoundConfig.to_record`` (the server) sends the values that differ from their defaults;
``RoundConfig.parse`` (the client) supplies the defaults and checks every value: the defaults are
written once. ``ReplyMetrics`` likewise for a reply's metrics. And no client or strategy module
reads a round-config key itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

import flower_dlion
from flower_dlion import DistributedLion
from flower_dlion.protocol import METRICS, RejectedReply
from flower_dlion.round_records import ALWAYS, ReplyMetrics, RoundConfig

PACKAGE = Path(flower_dlion.__file__).parent
KEYS = {f.replace("_", "-") for f in RoundConfig.__dataclass_fields__} - {"server-round", "version"}

configs = st.builds(
    RoundConfig,
    server_round=st.integers(1, 10**6),
    version=st.integers(0, 10**6),
    beta1=st.floats(0.0, 0.999),
    beta2=st.floats(0.0, 0.999),
    seed=st.integers(0, 2**32 - 1),
    local_steps=st.integers(1, 40),
    accumulate=st.integers(1, 25),
    local_optimizer=st.just("lion"),
    local_lr=st.sampled_from([0.0, 1e-3]),
    local_weight_decay=st.sampled_from([0.0, 0.1]),
    local_proximal_mu=st.sampled_from([0.0, 0.01]),
    stale_momentum=st.sampled_from(["keep", "decay", "reset"]),
    upload=st.sampled_from(["sign", "sum", "ef-sign"]),
    scale_block=st.sampled_from([0, 4096]),
    momentum_sync=st.booleans(),
    buffers=st.booleans(),
    momentum_sync_layers=st.sampled_from(["", "fc,conv1"]),
    state_key=st.sampled_from(["", "0123456789abcdef"]),
    state_round=st.one_of(st.none(), st.integers(-1, 100)),
    keep_round=st.integers(0, 100),
)


@settings(max_examples=200, deadline=None)
@given(configs)
def test_what_the_server_writes_the_client_reads_back(cfg: RoundConfig) -> None:
    # Execute
    record = cfg.to_record()
    # Assert: the same options; only the non-default values and the five always sent are on the wire
    assert RoundConfig.parse(record, 3) == cfg
    defaults = {f: RoundConfig.__dataclass_fields__[f].default for f in RoundConfig.__dataclass_fields__}
    sent = {k.replace("-", "_") for k in record}
    assert sent == ALWAYS | {f for f, v in defaults.items() if f not in ALWAYS and getattr(cfg, f) != v}


def test_the_default_strategy_sends_the_five_keys_the_run_key_and_xs_checksum() -> None:
    # Prepare
    from flower_dlion.strategies.server_state import Round

    s = DistributedLion(lr=1e-3, sample_seed=7)
    # Execute
    record = s.down.round_config(4, Round(server_round=4, base_version=0, base_checksum=123, lr=1e-3))
    # Assert
    assert dict(record) == {
        "server-round": 4,
        "version": 0,
        "seed": 7,
        "beta1": 0.9,
        "beta2": 0.99,
        "state-key": s.run_key,
        "x-checksum": 123,
    }


def test_no_library_module_reads_a_round_config_key_but_round_records() -> None:
    # Prepare: every read of a round-config key from a record whose name says config, in the clients and strategies
    found = []
    for path in sorted([*PACKAGE.glob("clients/*.py"), *PACKAGE.glob("strategies/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
                record, key = node.func.value, node.args[0] if node.args else None
            elif isinstance(node, ast.Subscript):
                record, key = node.value, node.slice
            else:
                continue
            if isinstance(key, ast.Constant) and key.value in KEYS and "config" in ast.unparse(record):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    # Assert: the defaults are supplied once, in round_records.py; the gradient baselines' and FedAvg's clients read
    # their own configs ("grad.config", Flower's "config"), not the round config
    assert [f for f in found if f.split(":")[0] not in ("fedavg.py", "gradient.py")] == []


def test_reply_metrics_round_trip_and_refuse_what_is_not_a_count() -> None:
    # Prepare
    metrics = ReplyMetrics(num_examples=64, train_loss=0.5, version=3, checksum=123456, coin_flips=2, context=3)
    # Execute
    back = ReplyMetrics.from_record(RecordDict({METRICS: metrics.to_record()}))
    # Assert
    assert back == metrics
    assert ReplyMetrics.from_record(RecordDict({METRICS: ReplyMetrics(1, 0.1, 0, 7).to_record()})).context is None
    bad = metrics.to_record()
    bad["version"] = 3.5
    with pytest.raises(RejectedReply, match=r"metric 'version' is 3\.5, expected an integer"):
        ReplyMetrics.from_record(RecordDict({METRICS: bad}))
    with pytest.raises(RejectedReply, match=r"metrics missing \['checksum'\]"):
        ReplyMetrics.from_record(RecordDict({METRICS: MetricRecord({"num-examples": 1, "train-loss": 0.1,
                                                                   "version": 0})}))  # fmt: skip
    assert isinstance(ConfigRecord(), ConfigRecord)
