"""Beyond the paper (issue 7): local steps, integer-sum and error-feedback uploads, p-bit
broadcasts, momentum sync, x₀ from a seed. Pure math first, then the strategy with mock
replies, then whole federations through the real ClientApp.
"""

import logging

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from hypothesis import given, settings
from hypothesis import strategies as st

from flower_dlion import codec, lion, quantizers
from flower_dlion.params import layer_mask
from flower_dlion.protocol import CLIENT_UPLOAD, CONFIG, METRICS, MOMENTUM, SERVER_UPDATE, checksum, message_bytes
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import read_config
from flower_dlion_app.model import Net, flat_parameters, seeded_net
from flower_dlion_app.server_app import build_strategy

from ..library.test_strategy import X0, StubGrid, first_round, signs_reply
from ..replies import with_arrays
from ..states import apply, load, node_at, replica_after

SIZES = [6, 4]  # the two tensors of test_strategy's model: "w" (2, 3) and "b" (4,)


# ---------------------------------------------------------------- quantizers and Lion math
def test_scaled_sign_uses_the_mean_magnitude_of_each_tensor() -> None:
    # Prepare
    v = torch.tensor([1.0, -3.0, 0.5, 0.5])
    # Execute
    levels, scales = quantizers.quantize(v, [2, 2], 2)
    # Assert
    assert levels.tolist() == [1, 0, 1, 1]
    assert scales.tolist() == [2.0, 0.5]
    assert quantizers.dequantize(levels, 2, scales, [2, 2]).tolist() == [2.0, -2.0, 0.5, 0.5]


def test_uniform_levels_round_to_the_nearest_point_of_a_symmetric_grid() -> None:
    # Prepare: scale = max|v| = 2, points {−2, 0, 2} for 3 levels, {−2, −1, 0, 1, 2}·… for 7
    v = torch.tensor([1.5, -0.4, 0.2, -2.0])
    # Execute
    levels3, s3 = quantizers.quantize(v, [4], 3)
    levels7, _ = quantizers.quantize(v, [4], 7)
    # Assert
    assert levels3.tolist() == [2, 1, 1, 0] and s3.tolist() == [2.0]
    assert quantizers.dequantize(levels3, 3, s3, [4]).tolist() == [2.0, 0.0, 0.0, -2.0]
    assert levels7.tolist() == [5, 2, 3, 0]  # round(3·v/2) + 3
    with pytest.raises(ValueError, match="odd number"):
        quantizers.quantize(v, [4], 4)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-4, 4, allow_nan=False, width=32), min_size=10, max_size=10),
    st.integers(1, 6),
    st.sampled_from([2, 3, 7]),
)
def test_error_feedback_sends_everything_eventually(first: list[float], rounds: int, num_levels: int) -> None:
    # Prepare: the same vector every round
    v = torch.tensor(first)
    error = torch.zeros(10)
    sent = torch.zeros(10, dtype=torch.float64)
    # Execute
    for _ in range(rounds):
        before = error.clone()
        levels, scales = quantizers.ef_quantize_(v, error, SIZES, num_levels)
        out = quantizers.dequantize(levels, num_levels, scales, SIZES)
        # Assert: e is exactly what this round did not send
        assert torch.equal(error, (v + before) - out)
        sent += out.double()
    # Assert: what was sent plus what is left is what went in (telescoping sum)
    np.testing.assert_allclose((sent + error.double()).numpy(), (rounds * v.double()).numpy(), atol=1e-4)


def test_local_steps_are_k_single_worker_lion_steps_and_return_the_sum_of_signs() -> None:
    # Prepare: f(x) = ½‖x − c‖², gradient x − c
    c = torch.tensor([1.0, -2.0, 0.5, 0.0])
    x0 = torch.tensor([0.0, 0.0, 1.0, 0.25])
    x, m = x0.clone(), torch.tensor([0.1, -0.1, 0.0, 0.3])
    x_ref, m_ref = x0.clone(), m.clone()
    seen = []

    def gradient(at: torch.Tensor, k: int) -> torch.Tensor:
        seen.append(k)
        return at - c

    # Execute
    u = lion.local_steps_(x, m, gradient, steps=3, lr=0.1, weight_decay=0.5, beta1=0.9, beta2=0.99)
    # Assert: three reference Lion steps (the last one's x update is left to the server)
    total = torch.zeros(4)
    for k in range(3):
        delta = lion.local_step_(m_ref, x_ref - c, 0.9, 0.99)
        total += delta
        if k < 2:
            lion.apply_update_(x_ref, delta, 0.1, 0.5)
    assert seen == [0, 1, 2]
    assert torch.equal(u, total) and torch.equal(m, m_ref) and torch.equal(x, x_ref)
    assert set(u.tolist()) <= {-3.0, -1.0, 1.0, 3.0}


def test_one_local_step_leaves_x_alone_and_returns_the_lion_direction() -> None:
    x, m, g = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -0.5]), torch.tensor([-1.0, 1.0])
    u = lion.local_steps_(x, m.clone(), lambda at, k: g, steps=1, lr=0.1, weight_decay=0.1, beta1=0.9, beta2=0.99)
    assert u.tolist() == [1.0, -1.0] and x.tolist() == [1.0, 2.0]  # sign(0.9·m + 0.1·g), x untouched


def test_aggregating_integer_sums_of_k_steps() -> None:
    # Prepare: n = 2 clients, K = 3 → S ∈ [−6, 6]
    s = torch.tensor([5, -3, 0, 1])
    # Execute
    mean = lion.aggregate(s, 2, "mean", k=3)
    vote = lion.aggregate(s, 2, "vote", k=3)
    # Assert: mean levels S + nK of 2nK + 1; values·K = S / n
    assert mean.num_levels == 13 and mean.levels.tolist() == [11, 3, 6, 7]
    assert (codec.levels_to_values(*mean) * 3).tolist() == [2.5, -1.5, 0.0, 0.5]
    assert vote.num_levels == 3 and vote.levels.tolist() == [2, 0, 1, 2]
    assert lion.aggregate(torch.tensor([1, -3]), 3, "vote", k=2).num_levels == 3  # S can be 0 even for odd n


def test_seeded_net_is_the_servers_initial_model_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(7)
    expected = flat_parameters(Net())
    torch.manual_seed(123)
    before = torch.get_rng_state()
    assert torch.equal(flat_parameters(seeded_net(7)), expected)
    assert torch.equal(torch.get_rng_state(), before)


def test_layer_mask_selects_by_name_prefix() -> None:
    names = [("features.0.weight", (2, 2)), ("features.0.bias", (2,)), ("classifier.1.weight", (3,))]
    assert layer_mask(names, ("features.0.bias", "classifier")).tolist() == [False] * 4 + [True] * 5
    assert bool(layer_mask(names, ()).all())


# ---------------------------------------------------------------- strategy with mock replies
def levels_reply(instruction: Message, levels: list[int], num_levels: int) -> Message:
    cfg = instruction.content[CONFIG]
    data = codec.encode_levels(torch.tensor(levels), num_levels).numpy().tobytes()
    array = Array(dtype="level", shape=(len(levels),), stype="dlion.levels", data=data)
    metrics = {"num-examples": 32, "train-loss": 1.0, "version": cfg["version"], "checksum": checksum(torch.tensor(X0))}
    return Message(
        RecordDict({CLIENT_UPLOAD: ArrayRecord({"levels": array}), METRICS: MetricRecord(metrics)}),
        reply_to=instruction,
    )


def test_integer_sum_upload_with_mean_applies_the_mean_of_the_sums() -> None:
    # Prepare: K = 2 local steps, U ∈ [−2, 2] → levels U + 2 of 5
    strategy = DistributedLion(aggregation="mean", lr=0.1, weight_decay=0.5, local_steps=2, upload="sum")
    sent = first_round(strategy, [1, 2])
    u1 = [2, -2, 0, 1, -1, 2, 2, 0, -2, 1]
    u2 = [2, 0, 0, -1, -1, -2, 1, 0, -2, 1]
    # Execute
    _, metrics = strategy.aggregate_train(
        1, [levels_reply(sent[1], [u + 2 for u in u1], 5), levels_reply(sent[2], [u + 2 for u in u2], 5)]
    )
    # Assert: x ← x − lr·(ΣU/n + K·wd·x), three IEEE roundings as in apply_update_
    delta = torch.tensor([(a + b) / 2 for a, b in zip(u1, u2, strict=True)])
    x = torch.from_numpy(X0.copy()).mul_(1 - 0.1 * 0.5 * 2).sub_(delta * 0.1)
    assert torch.equal(strategy.x, x)
    assert metrics["num-replies"] == 2 and metrics["agreement"] == pytest.approx(
        float(sum(abs(a + b) for a, b in zip(u1, u2, strict=True))) / 10 / 4
    )
    cfg = sent[1].content[CONFIG]
    assert cfg["local-steps"] == 2 and cfg["upload"] == "sum" and cfg["local-lr"] == 0.1


def test_integer_sum_reply_with_a_level_out_of_range_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: 3 bits per value hold 0…7 but K = 2 allows only 0…4
    strategy = DistributedLion(aggregation="mean", lr=0.1, local_steps=2, upload="sum")
    sent = first_round(strategy, [1, 2])
    x_before = strategy.x.clone()
    bad = levels_reply(sent[1], [0] * 10, 5)
    data = bytearray(bad.content[CLIENT_UPLOAD]["levels"].data)
    data[0] = data[4] = 0xFF  # bit planes 0 and 2 of values 0…7: level 5
    bad.content[CLIENT_UPLOAD]["levels"].data = bytes(data)
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    _, metrics = strategy.aggregate_train(1, [bad, levels_reply(sent[2], [2] * 10, 5)])
    # Assert: the bad reply is out, the other one applied (U = 0 → only weight decay)
    assert metrics["num-rejected"] == 1 and metrics["num-replies"] == 1
    assert "rejected reply from node 1 (partition 1): Array 'levels': level above 4" in caplog.text
    assert torch.equal(strategy.x, x_before.mul(1 - 0.1 * 0.1 * 2).sub_(torch.zeros(10)))


def test_ef_sign_upload_and_one_bit_broadcast_with_server_error_feedback() -> None:
    # Prepare: 3 clients send scaled signs, the third claims a scale of 10³⁰ for the first tensor;
    # the server broadcasts a scaled sign of mean + e
    strategy = DistributedLion(aggregation="mean", lr=0.1, weight_decay=0.0, upload="ef-sign", broadcast_bits=1)
    sent = first_round(strategy, [1, 2, 3])
    signs = [[1, 1, -1, -1, 1, -1, 1, 1, -1, 1], [1, -1, -1, 1, 1, -1, -1, 1, -1, 1], [-1] * 10]
    claimed = [np.array([2.0, 1.0], np.float32), np.array([1.0, 3.0], np.float32), np.array([1e30, 5.0], np.float32)]
    replies = [
        with_arrays(sent[n], signs_reply(sent[n], signs[n - 1]), scales=Array(claimed[n - 1])) for n in (1, 2, 3)
    ]
    # Execute
    _, metrics = strategy.aggregate_train(1, replies)
    nxt = strategy.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    # Assert: every scale cut to its tensor's lower median (tensor 1: 2, tensor 2: 3), so the liar
    # counts as [2, 3], as much as the median client; the mean of the scaled signs, then its scaled
    # sign per tensor; the rest stays as e
    assert metrics["clipped-scales"] == 2  # the liar's two scales
    cut = [np.minimum(c, [2.0, 3.0]).astype(np.float32) for c in claimed]
    mean = sum(np.array(s) * np.repeat(c, SIZES) for s, c in zip(signs, cut, strict=True)).astype(np.float32) / 3
    scales = [np.abs(mean[:6]).mean(), np.abs(mean[6:]).mean()]
    sent_delta = np.where(mean >= 0, 1.0, -1.0) * np.repeat(np.array(scales, np.float32), SIZES)
    np.testing.assert_allclose(strategy.x.numpy(), X0 - 0.1 * sent_delta, rtol=1e-6)
    np.testing.assert_allclose(strategy.state.server_error.numpy(), mean - sent_delta, rtol=1e-6, atol=1e-7)
    # … and the broadcast carries the scales, which give clients exactly the server's x
    cfg = nxt[0].content[CONFIG]
    assert cfg["num-levels"] == [2] and len(cfg["scales"]) == 2
    state = apply(nxt[0].content, node_at(X0), strategy.spec)
    assert torch.equal(state.replica.x, strategy.x)


def test_ef_sign_reply_without_valid_scales_is_rejected() -> None:
    # Prepare
    strategy = DistributedLion(aggregation="mean", lr=0.1, upload="ef-sign", broadcast_bits=1)
    sent = first_round(strategy, [1, 2, 3])
    good = with_arrays(sent[1], signs_reply(sent[1], [1] * 10), scales=Array(np.ones(2, np.float32)))
    missing = signs_reply(sent[2], [1] * 10)
    negative = with_arrays(sent[3], signs_reply(sent[3], [1] * 10), scales=Array(np.array([1.0, -1.0], np.float32)))
    # Execute
    _, metrics = strategy.aggregate_train(1, [good, missing, negative])
    # Assert
    assert metrics["num-replies"] == 1 and metrics["num-rejected"] == 2


def test_momentum_sync_round_takes_the_median_of_the_momenta_and_sends_it_next_round() -> None:
    # Prepare: sync every 2 rounds, layer "b" only (4 values)
    strategy = DistributedLion(lr=0.1, momentum_sync_every=2, momentum_sync_layers=("b",))
    sent = first_round(strategy, [1, 2, 3])
    assert "momentum-sync" not in sent[1].content[CONFIG]
    strategy.aggregate_train(1, [signs_reply(sent[n], [1] * 10, x=strategy.x.clone()) for n in (1, 2, 3)])
    x1 = strategy.x.clone()
    msgs = {
        m.metadata.dst_node_id: m
        for m in strategy.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    }
    assert msgs[1].content[CONFIG]["momentum-sync"] == 1 and msgs[1].content[CONFIG]["momentum-sync-layers"] == "b"
    momenta = [np.array([1, 2, 3, 4], np.float32), np.array([3, 2, 1, 0], np.float32), np.zeros(4, np.float32)]
    replies = [
        with_arrays(msgs[n], signs_reply(msgs[n], [1] * 10, x=x1), momentum=Array(momenta[n - 1])) for n in (1, 2)
    ] + [signs_reply(msgs[3], [1] * 10, x=x1)]  # node 3 forgot its momentum: rejected
    # Execute
    _, metrics = strategy.aggregate_train(2, replies)
    third = strategy.configure_train(3, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    fourth = strategy.configure_train(4, ArrayRecord(), ConfigRecord(), StubGrid([1, 2]))
    # Assert: the coordinate-wise median of the two valid momenta (of two: their mean) goes to every
    # node in the next round only
    assert metrics["num-rejected"] == 1
    for msg in third:
        assert msg.content[MOMENTUM]["m"].numpy().tolist() == [2.0, 2.0, 2.0, 2.0]
    assert all(MOMENTUM not in msg.content for msg in fourth)


@pytest.mark.parametrize(("downlink", "kind"), [("chain", "deltas"), ("anchored", "counts")])
def test_init_seed_sends_the_seed_instead_of_the_model_and_falls_back_on_mismatch(
    downlink: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: X0 plays x₀ "of seed 5"
    full = DistributedLion(lr=0.1, downlink=downlink)
    seeded = DistributedLion(lr=0.1, init_seed=5, downlink=downlink)
    full_msgs = first_round(full, [1, 2])
    sent = first_round(seeded, [1, 2])
    # Assert: no model on the wire, seed and checksum instead (the anchored downlink: kind "counts", no segment)
    cfg = sent[1].content[CONFIG]
    assert (
        cfg["kind"] == {"chain": "none", "anchored": "counts"}[downlink]
        and cfg["init-seed"] == 5
        and cfg["init-checksum"] == checksum(torch.tensor(X0))
    )
    assert SERVER_UPDATE not in sent[1].content
    assert message_bytes(sent[1]) < message_bytes(full_msgs[1]) - 39  # 40 B of float32 model gone
    # Execute: node 2's x₀ does not match (its client raised); node 1 is fine
    error = Message(
        Error(code=2, reason="ClientStateError: node 2: x0 built from seed 5 has checksum 1"), reply_to=sent[2]
    )
    caplog.set_level(logging.WARNING, logger="flwr")
    seeded.aggregate_train(1, [signs_reply(sent[1], [1] * 10), error])
    nxt = {
        m.metadata.dst_node_id: m for m in seeded.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    }
    # Assert: node 2 now gets the full model; a new node 3 gets the seed and the Δ since x₀
    assert nxt[1].content[CONFIG]["kind"] == kind and "init-seed" not in nxt[1].content[CONFIG]
    assert nxt[2].content[CONFIG]["kind"] == "full"
    assert nxt[3].content[CONFIG]["kind"] == kind and nxt[3].content[CONFIG]["init-seed"] == 5
    assert nxt[3].content[CONFIG]["base-version"] == 0
    # Assert: the server said once what went wrong and how to fix it, naming the node and the seed
    said = [r.getMessage() for r in caplog.records if "torch.manual_seed(5)" in r.getMessage()]
    assert len(said) == 1 and "node 2 built x₀" in said[0] and "initial_arrays" in said[0]
    third = {
        m.metadata.dst_node_id: m for m in seeded.configure_train(3, ArrayRecord(), ConfigRecord(), StubGrid([1, 2, 3]))
    }
    assert third[3].content[CONFIG]["init-seed"] == 5  # node 3 is sent the seed again: its x₀ is unknown
    seeded.aggregate_train(3, [Message(Error(code=2, reason=error.error.reason), reply_to=third[3])])
    assert sum("torch.manual_seed(5)" in r.getMessage() for r in caplog.records) == 1  # once per run


def test_options_are_checked_with_precise_errors() -> None:
    with pytest.raises(ValueError, match="local_steps must be >= 1"):
        DistributedLion(local_steps=0)
    with pytest.raises(ValueError, match="upload must be"):
        DistributedLion(upload="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs broadcast_bits >= 1"):
        DistributedLion(aggregation="mean", upload="ef-sign")
    with pytest.raises(ValueError, match=r"lr \* weight_decay \* local_steps must be <= 0.5 \(got 0.6"):
        DistributedLion(lr=0.1, weight_decay=1.0, local_steps=6)
    DistributedLion(lr=0.1, weight_decay=1.0, local_steps=5)  # 0.5: the bound itself is allowed
    with pytest.raises(ValueError, match="needs 'broadcast-bits' >= 1"):
        read_config({"strategy": "dlion-mean", "upload": "ef-sign"})
    with pytest.raises(ValueError, match=r"apply to .* only, not to 'fedavg'"):
        read_config({"strategy": "fedavg", "local-steps": 5})
    with pytest.raises(ValueError, match="'upload' must be one of"):
        read_config({"upload": "float"})


# ---------------------------------------------------------------- whole federations
OPTIONS = {
    "accumulate": {"strategy": "dlion-vote", "accumulate": 3},
    "sum-mean": {"strategy": "dlion-mean", "local-steps": 3, "upload": "sum"},
    "sign-vote": {"strategy": "dlion-vote", "local-steps": 3},
    "ef-sign-1bit": {"strategy": "dlion-mean", "local-steps": 3, "upload": "ef-sign", "broadcast-bits": 1},
    "ef-sign-blocks": {
        "strategy": "dlion-mean",
        "local-steps": 3,
        "upload": "ef-sign",
        "broadcast-bits": 1,
        "scale-block": 1000,
        "lr-schedule": "cosine",
        "lr-final": 0.5,
        "num-server-rounds": 4,
    },
    "ef-sign-2bit-seed": {
        "strategy": "dlion-mean",
        "local-steps": 2,
        "upload": "ef-sign",
        "broadcast-bits": 2,
        "init": "seed",
    },
    "momentum-sync": {"strategy": "dlion-vote", "momentum-sync-every": 2, "momentum-sync-layers": "classifier.3"},
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_option_keeps_every_replica_equal_to_the_server_x(name: str, tmp_path) -> None:
    # Prepare: 3 clients, 4 rounds through the real ClientApp with serialized messages and contexts
    run_config = {"partitioner": "iid", "batch-size": 16, "lr": 0.01, **OPTIONS[name]}
    cfg = read_config(run_config)
    strategy = build_strategy(cfg)
    grid = LocalGrid(client_app, 3, run_config=run_config)
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    sizes_seen = []
    # Execute
    for rnd in range(1, 5):
        msgs = strategy.configure_train(rnd, arrays, ConfigRecord({"batch-size": 16, "seed": 0}), grid)
        replies = grid.send_and_receive(msgs)
        sizes_seen.append(max(message_bytes(r) for r in replies))
        _, metrics = strategy.aggregate_train(rnd, replies)
        assert metrics["num-replies"] == 3 and metrics["num-rejected"] == 0
    # Assert: what each client would apply next gives exactly the server's x
    for msg in strategy.configure_train(5, ArrayRecord(), ConfigRecord(), grid):
        node = msg.metadata.dst_node_id
        assert load(grid.context(node)) is not None
        replica = replica_after(msg.content, grid.context(node), strategy.spec, node)
        assert torch.equal(replica, strategy.x)
    assert strategy.x.isfinite().all() and not torch.equal(strategy.x, flat_parameters(Net()))


@pytest.mark.parametrize(
    ("options", "bits"),
    [
        ({"strategy": "dlion-mean", "local-steps": 20, "upload": "sum"}, 6),  # ⌈log₂ 41⌉ bit planes
        ({"strategy": "dlion-mean", "local-steps": 2, "upload": "ef-sign", "broadcast-bits": 1}, 1),
    ],
)
def test_measured_upload_bytes_follow_the_encoding(options: dict, bits: int) -> None:
    # Prepare
    run_config = {"partitioner": "iid", "batch-size": 8, **options}
    strategy = build_strategy(read_config(run_config))
    grid = LocalGrid(client_app, 2, run_config=run_config)
    torch.manual_seed(0)
    arrays = ArrayRecord(Net().state_dict())
    # Execute
    replies = grid.send_and_receive(strategy.configure_train(1, arrays, ConfigRecord({"batch-size": 8}), grid))
    d = strategy.num_parameters
    # Assert: payload bytes plus a fixed header that does not grow with d (about 0.9 KB for the
    # record tree and metrics, and about 0.45 KB for the scales Array of the ef-sign upload)
    for reply in replies:
        payload = bits * codec.packed_size(d)
        assert payload < message_bytes(reply) < payload + 1536


def test_one_client_uploads_exactly_the_k_step_sum_and_keeps_its_quantization_error() -> None:
    # Prepare: 1 client, K = 3 local steps on its own minibatches (steps 0, 1, 2 of round 1)
    from flower_dlion_app.data import load_fashion_mnist, partition_indices, sample_batch, to_tensor
    from flower_dlion_app.model import flat_gradient

    lr, wd, k = 0.01, 0.1, 3
    ds = load_fashion_mnist()
    rows = partition_indices(ds.y_train, partitioner="iid", num_partitions=1)[0]

    def gradient(x: torch.Tensor, step: int) -> torch.Tensor:
        batch = sample_batch(rows, 16, seed=0, partition_id=0, server_round=1, step=step)
        return flat_gradient(Net(), x, to_tensor(ds.x_train[batch]), torch.from_numpy(ds.y_train[batch]))[1]

    x0 = flat_parameters(seeded_net(0))
    u_ref = lion.local_steps_(
        x0.clone(), torch.zeros_like(x0), gradient, steps=k, lr=lr, weight_decay=wd, beta1=0.9, beta2=0.99
    )
    sizes = [p.numel() for p in Net().parameters()]
    results = {}
    for upload in ("sum", "ef-sign"):
        run_config = {
            "partitioner": "iid",
            "batch-size": 16,
            "strategy": "dlion-mean",
            "lr": lr,
            "weight-decay": wd,
            "local-steps": k,
            "upload": upload,
            "broadcast-bits": 1 if upload == "ef-sign" else 0,
        }
        strategy = build_strategy(read_config(run_config))
        strategy.min_train_nodes = strategy.min_available_nodes = 1
        grid = LocalGrid(client_app, 1, run_config=run_config)
        # Execute: one round
        msgs = strategy.configure_train(1, ArrayRecord(seeded_net(0).state_dict()), ConfigRecord({"seed": 0}), grid)
        strategy.aggregate_train(1, grid.send_and_receive(msgs))
        results[upload] = (strategy, load(grid.context(grid.node_ids[0])))
    # Assert (sum): the server applied U/n with n = 1, exactly: x0 − lr·(U + K·wd·x0)
    expected = x0.clone()
    lion.apply_update_(expected, u_ref, lr, wd * k)
    assert torch.equal(results["sum"][0].x, expected)
    # Assert (ef-sign): the client sent the scaled sign of U and kept the rest as e
    levels, scales = quantizers.quantize(u_ref, sizes, 2)
    sent = quantizers.dequantize(levels, 2, scales, sizes)
    _, state = results["ef-sign"]
    assert state is not None and state.error is not None
    torch.testing.assert_close(state.error, u_ref - sent, rtol=0, atol=1e-6)


def test_float_aggregation_does_not_depend_on_the_order_of_the_replies() -> None:
    # Prepare: Flower samples (and so orders) nodes with the unseeded global `random`
    import random

    run_config = {"partitioner": "iid", "batch-size": 8, **OPTIONS["ef-sign-1bit"]}
    finals = []
    for order_seed in (1, 2):
        random.seed(order_seed)
        strategy = build_strategy(read_config(run_config))
        grid = LocalGrid(client_app, 3, run_config=run_config)
        torch.manual_seed(0)
        arrays = ArrayRecord(Net().state_dict())
        # Execute: two rounds, the replies reversed in the second run
        for rnd in (1, 2):
            replies = list(grid.send_and_receive(strategy.configure_train(rnd, arrays, ConfigRecord(), grid)))
            strategy.aggregate_train(rnd, replies if order_seed == 1 else replies[::-1])
        finals.append(strategy.x.clone())
    # Assert: bit-identical models (the server sums the scaled signs in node-id order)
    assert torch.equal(finals[0], finals[1])


@pytest.mark.parametrize("scaled", [False, True])
def test_apply_delta_is_the_update_of_the_dequantized_levels(scaled: bool) -> None:
    # Prepare: 2 tensors (3 + 4 values), L = 3 levels, per-tensor scales or none; hand-computed Δ
    x = torch.tensor([1.0, -2.0, 0.5, 4.0, 0.0, -1.0, 8.0])
    levels = torch.tensor([0, 1, 2, 2, 0, 1, 2], dtype=torch.int32)
    scales = torch.tensor([0.5, 2.0]) if scaled else None
    delta = torch.tensor([-1.0, 0.0, 1.0, 1.0, -1.0, 0.0, 1.0])  # (2k − 2) / 2
    if scaled:
        delta = delta * torch.tensor([0.5] * 3 + [2.0] * 4)
    expected = lion.apply_update_(x.clone(), delta, 0.1, 0.01)
    # Execute
    got = quantizers.apply_delta_(x, levels, 3, scales, [3, 4], 0.1, 0.01)
    # Assert: in place, bit for bit the reference Lion update
    assert got is x and torch.equal(x, expected)
