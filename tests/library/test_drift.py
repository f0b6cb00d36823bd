"""Drift correction (SCAFFOLD option II, ``drift_correction="scaffold"``) and server momentum in the 1-bit SGD mode."""

from __future__ import annotations

import logging
import zlib
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from flower_dlion import DistributedLion, DLionClient, codec, drift, quantizers
from flower_dlion.clients.drift_state import correction
from flower_dlion.clients.local_work import _sgd_ef_sign_drift
from flower_dlion.clients.placement import Placement
from flower_dlion.clients.resident import NodeState, Replica
from flower_dlion.clients.state import HostState
from flower_dlion.clients.state_store import read_state_file, write_state_file
from flower_dlion.protocol import CONFIG, LEVELS_STYPE, SERVER_UPDATE, ClientStateError
from flower_dlion.round_records import RoundConfig
from flower_dlion.strategies.server_delta import quantized_delta
from flower_dlion.strategies.server_state import ServerState
from flower_dlion.testing import LocalGrid
from flower_dlion.uploads import UPLOADS, Shape

EF_SGD = {  # the "ef-sgd" mode of docs/RESULTS.md, "Strong skew on the test grid"
    "aggregation": "mean", "local_optimizer": "sgd", "local_lr": 0.1, "upload": "ef-sign",
    "broadcast_bits": 1, "lr": 1.0, "weight_decay": 0.0,
}  # fmt: skip


PLACE = Placement(torch.device("cpu"))


class _Work:
    """A LocalWork stand-in: the gradient of ½‖y − a‖² (y − a)."""

    def __init__(self, a: torch.Tensor) -> None:
        self.a = a

    def gradient(self, y: torch.Tensor, step: int) -> torch.Tensor:
        return y - self.a


def _node(x: list[float], h: list[float] | None = None, rnd: int = 4) -> NodeState:
    replica = Replica(version=4, x=torch.tensor(x), checksum=0)
    node = NodeState(replica=replica, m=torch.zeros(len(x)))
    if h is not None:
        node.drift = drift.Drift(torch.tensor(h), rnd)
    return node


def _cfg(**kw: object) -> RoundConfig:
    base = {"server_round": 5, "version": 5, "beta1": 0.9, "beta2": 0.99, "local_steps": 2, "local_lr": 0.5,
            "local_optimizer": "sgd", "upload": "ef-sign", "drift_correction": "scaffold"}  # fmt: skip
    return RoundConfig(**(base | kw))  # type: ignore[arg-type]


# ---------------------------------------------------------------- the local step's math
def test_two_corrected_sgd_steps_on_a_quadratic_give_the_hand_computed_upload_and_state() -> None:
    # Prepare: x = (1, −1), g(y) = y, K = 2, η = 0.5, h − hᵢ = (0.25, 0.5): c − cᵢ = (h − hᵢ)/(K·η) = (0.25, 0.5)
    node, diff = _node([1.0, -1.0]), torch.tensor([0.25, 0.5])
    # Execute
    arrays = partial(_sgd_ef_sign_drift, diff=diff)(
        node, _cfg(), [2], _Work(torch.zeros(2)), torch.Generator(), None, []
    )  # type: ignore[arg-type]
    # Assert: y₁ = (0.375, −0.75), y₂ = (0.0625, −0.625), u = x − y₂ = (0.9375, −0.375) = η·Σg + (h − hᵢ);
    # scale mean|u| = 0.65625, û = (0.65625, −0.65625), e = u − û; hᵢ ← u − (h − hᵢ) = η·Σg, not û − (h − hᵢ)
    assert codec.unpack_bits(arrays["signs"].data, 2).tolist() == [True, False]
    assert arrays["scales"].numpy().tolist() == [0.65625]
    assert node.error is not None and node.error.tolist() == [0.28125, 0.28125]
    assert node.drift is not None and node.drift.h.tolist() == [0.6875, -0.875] and node.drift.round == 5
    assert node.drift.signs is not None and node.drift.signs.tolist() == [0b10000000]
    assert node.drift.scales is not None and node.drift.scales.tolist() == [0.65625]


def test_an_uncorrected_round_is_plain_sgd_and_keeps_its_own_update_not_the_decoded_upload() -> None:
    # Prepare / Execute: no correction (diff None): y₁ = (0.5, −0.25), y₂ = (0.25, −0.125), u = (0.75, −0.375)
    node = _node([1.0, -0.5])
    partial(_sgd_ef_sign_drift, diff=None)(node, _cfg(), [2], _Work(torch.zeros(2)), torch.Generator(), None, [])  # type: ignore[arg-type]
    # Assert: hᵢ = u (the decoded upload would be 0.5625·(1, −1))
    assert node.drift is not None and node.drift.h.tolist() == [0.75, -0.375]


# ---------------------------------------------------------------- the state's life cycle
def _one_delta(levels: list[int], scale: float, base: int = 4) -> RecordDict:
    """A chain message with one 1-bit Δ from version ``base``, scale ``scale``."""
    encoded = codec.encode_levels(torch.tensor(levels, dtype=torch.int32), 2).numpy().tobytes()
    payload = Array(dtype="level", shape=(len(levels),), stype=LEVELS_STYPE, data=encoded)
    config = {"kind": "deltas", "base-version": base, "num-levels": [2], "lr": [1.0], "weight-decay": [0.0],
              "scales": [scale]}  # fmt: skip
    return RecordDict({CONFIG: ConfigRecord(config), SERVER_UPDATE: ArrayRecord({"payload": payload})})


def test_the_correction_is_the_last_broadcast_minus_the_clients_state() -> None:
    # Prepare: hᵢ of round 4, the message's one Δ from version 4: Δ̂ = 0.5·(+1, −1)
    node = _node([0.0, 0.0], h=[0.125, 0.25], rnd=4)
    # Execute
    diff = correction(node, 4, _cfg(), _one_delta([1, 0], 0.5), [2], 7, PLACE)
    # Assert
    assert diff is not None and diff.tolist() == [0.375, -0.75]


def test_the_clients_state_loses_what_the_server_cut_of_its_scales() -> None:
    # Prepare: hᵢ = (0.125, 0.25) made from an upload of signs (+, −) at scale 0.5; the server cut it to 0.375
    node = _node([0.0, 0.0], h=[0.125, 0.25], rnd=4)
    assert node.drift is not None
    node.drift.signs, node.drift.scales = np.array([0b10000000], np.uint8), np.array([0.5], np.float32)
    # Execute
    diff = correction(node, 4, _cfg(drift_limits=(0.375,)), _one_delta([1, 0], 0.5), [2], 7, PLACE)
    # Assert: hᵢ as the server counted it, (0.125 − 0.125, 0.25 + 0.125); h − that; the state itself unchanged
    assert diff is not None and diff.tolist() == [0.5, -0.875]
    assert node.drift.h.tolist() == [0.125, 0.25]


@pytest.mark.parametrize(
    ("h", "rnd", "before", "level", "why"),
    [
        (None, 4, 4, logging.INFO, "it has none"),
        ([float("nan"), 0.0], 4, 4, logging.WARNING, "non-finite"),
        ([0.0, 0.0, 0.0], 4, 4, logging.WARNING, "the model needs float32 (2,)"),
        ([0.0, 0.0], 3, 4, logging.INFO, "a missed round"),
        ([0.0, 0.0], 4, 3, logging.INFO, "not the one Δ after its version"),
        ([0.0, 0.0], 4, 4, logging.INFO, "drift-limits do not fit its upload"),
    ],
)
def test_a_state_that_cannot_be_used_runs_the_round_uncorrected_and_says_so(
    caplog: pytest.LogCaptureFixture, h: list[float] | None, rnd: int, before: int, level: int, why: str
) -> None:
    # Prepare: missing, non-finite, of another shape, of an older round, or a message that is not one Δ
    caplog.set_level(logging.INFO, logger="flower_dlion")
    node = _node([0.0, 0.0], h=h, rnd=rnd)
    if node.drift is not None and "limits" in why:  # two limits for its one block
        node.drift.signs, node.drift.scales = np.array([0], np.uint8), np.array([0.5], np.float32)
    cfg = _cfg(drift_limits=(0.25, 0.25) if "limits" in why else ())
    # Execute
    diff = correction(node, before, cfg, _one_delta([1, 0], 0.5, base=before), [2], 7, PLACE)
    # Assert: none applied, a line naming the node and why; a damaged state is dropped
    assert diff is None
    lines = [r for r in caplog.records if "node 7" in r.getMessage() and why in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == level
    if level == logging.WARNING:
        assert node.drift is None


def test_the_state_is_persisted_with_the_node_and_a_file_without_it_still_loads(tmp_path: Path) -> None:
    # Prepare: a host state with hᵢ, and one as an older client wrote it (no hᵢ)
    m = np.zeros(3, np.float32)
    h, signs, scales = np.array([1, 2, 3], np.float32), np.array([0b101], np.uint8), np.array([0.5], np.float32)
    with_h = HostState(version=2, round=2, checksum=0, m=m, x=m, drift=h, drift_round=2)
    with_h.drift_signs, with_h.drift_scales = signs, scales
    without = HostState(version=2, round=2, checksum=0, m=m, x=m)
    # Execute: written and read back as files
    loaded = []
    for i, host in enumerate((with_h, without)):
        write_state_file(tmp_path / f"{i}.state", host)
        meta, arrays = read_state_file(tmp_path / f"{i}.state")
        loaded.append(HostState.from_parts(meta, arrays, {}, None, b""))
    # Assert
    assert loaded[0].drift is not None and loaded[0].drift.tolist() == [1, 2, 3] and loaded[0].drift_round == 2
    assert loaded[0].drift_signs is not None and loaded[0].drift_signs.tolist() == [5]
    assert loaded[0].drift_scales is not None and loaded[0].drift_scales.tolist() == [0.5]
    assert loaded[1].drift is None and loaded[1].drift_round == -1
    assert "drift-round" not in without.meta()  # an old client reads a new file: one key more, nothing less


# ---------------------------------------------------------------- the option's checks
@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"drift_correction": "bogus"}, "drift_correction must be one of ('off', 'scaffold'), got 'bogus'"),
        ({"drift_correction": "scaffold", "local_optimizer": "lion", "local_lr": None}, "local_optimizer='lion'"),
        ({"drift_correction": "scaffold", "upload": "sign", "aggregation": "vote"}, "upload='sign'"),
        ({"drift_correction": "scaffold", "server_momentum": 0.5}, "server_momentum=0.5"),
    ],
)
def test_drift_correction_is_refused_where_it_does_not_apply(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match="drift_correction") as err:
        DistributedLion(**(EF_SGD | kwargs))  # type: ignore[arg-type]
    assert says in str(err.value)


def test_the_client_refuses_a_drift_correction_key_out_of_range() -> None:
    record: dict[str, object] = {"server-round": 1, "version": 0, "beta1": 0.9, "beta2": 0.99, "drift-correction": "x"}
    with pytest.raises(ClientStateError, match="drift-correction = 'x'"):
        RoundConfig.parse(record, 3)
    with pytest.raises(ClientStateError, match="'sgd' and 'ef-sign' needed"):
        RoundConfig.parse(record | {"drift-correction": "scaffold"}, 3)
    assert RoundConfig.parse(record | {"drift-correction": "off"}, 3).to_record().get("drift-correction") is None
    del record["drift-correction"]
    for bad in ([float("nan")], [-1.0], [2e6], [1]):
        with pytest.raises(ClientStateError, match="drift-limits"):
            RoundConfig.parse(record | {"drift-limits": bad}, 3)
    cfg = RoundConfig.parse(record | {"drift-limits": [0.5, 0.25]}, 3)
    assert cfg.drift_limits == (0.5, 0.25) and RoundConfig.parse(cfg.to_record(), 3) == cfg


# ---------------------------------------------------------------- the sums agree: Σ(c − cᵢ) is the residuals'
class _ServerState:
    server_error: torch.Tensor | None = None
    outer_momentum: torch.Tensor | None = None


def _federation(scaffold: bool, rounds: int, *, noise: float = 0.0, cut: bool = True) -> tuple[float, list[float]]:
    """4 clients on ½‖y − aᵢ‖² (+ noise), K = 20, ef-sign up, the strategy's own 1-bit mean down (scales clipped).

    The clients run the library's drift math (``cut``: they learn where the server cut their scales, as
    ``drift-limits`` tells them). Returns ‖x − x*‖ at the end and, each round, max |mean hᵢ − h − e − mean eᵢ|
    (e the server's error-feedback residual, eᵢ the clients').
    """
    torch.manual_seed(0)
    n, d, sizes, steps, lr = 4, 40, [20, 20], 20, 0.1
    targets = [torch.randn(d) * 3 for _ in range(n)]
    kind, shape, g = UPLOADS["ef-sign"], Shape(d, sizes, 1), torch.Generator().manual_seed(1)
    x, h, server = torch.zeros(d), torch.zeros(d), _ServerState()
    states, errors, kept = [torch.zeros(d)] * n, [None] * n, [None] * n
    gaps = []
    for t in range(rounds):
        parsed = []
        for i in range(n):
            diff = h - states[i] if scaffold and t else None
            y = x.clone()
            for _k in range(steps):
                grad = y - targets[i] + noise * torch.randn(d, generator=g)
                y -= lr * (grad if diff is None else grad + drift.offset(diff, steps, lr))
            states[i] = drift.next_state(x - y, diff)
            arrays, errors[i] = kind.encode(x - y, errors[i], shape, torch.Generator(), [])
            scales = torch.from_numpy(arrays["scales"].numpy().copy())
            kept[i] = codec.unpack_bits(arrays["signs"].data, d), scales
            parsed.append(kind.parse(arrays["signs"].data, {"scales": scales}, shape))
        step = quantized_delta(parsed, shape, server, kind=kind, how="mean", broadcast_bits=1, momentum=0.0)
        h = quantizers.dequantize(step.levels, 2, torch.tensor(step.scales), sizes)
        x = x - h
        assert step.limits is not None and server.server_error is not None
        if cut:  # what each client does at the start of the next round: hᵢ less what the server cut
            limits = torch.tensor(step.limits)
            states = [s - drift.clipped_part(*kept[i], limits, sizes) for i, s in enumerate(states)]
        residuals = server.server_error + torch.stack(errors).mean(0)
        gaps.append(float((torch.stack(states).mean(0) - h - residuals).abs().max()))
    return float((x - torch.stack(targets).mean(0)).norm()), gaps


def test_with_full_participation_the_clients_mean_state_minus_h_is_the_error_feedback_residuals() -> None:
    # Execute: 8 rounds, the server's median clipping included, the clients told where it cut
    _, gaps = _federation(True, 8)
    _, uncut = _federation(True, 8, cut=False)
    # Assert: mean hᵢ − h = e + mean eᵢ, the broadcast's and the uploads' residuals, each round (not without the limits)
    assert max(gaps) < 1e-5
    assert max(uncut) > 1e-2


def test_on_skewed_quadratics_the_correction_reaches_the_optimum_plain_ef_sgd_drifts_from() -> None:
    # Execute: the same noisy federation without and with the correction, and with it but without the limits
    plain, _ = _federation(False, 60, noise=0.3)
    corrected, _ = _federation(True, 60, noise=0.3)
    uncut, _ = _federation(True, 60, noise=0.3, cut=False)
    print(f"quadratics, 60 rounds: ‖x − x*‖ plain {plain:.3f}, scaffold {corrected:.3f}, without limits {uncut:.3f}")
    # Assert
    assert corrected < plain / 10 and corrected < uncut


# ---------------------------------------------------------------- the server momentum of the 1-bit SGD mode
def test_server_momentum_on_ef_sign_means_is_fedavgm_in_nesterov_form() -> None:
    # Prepare: ef-sign uploads averaged, broadcast at 1 bit; μ = 0.75
    torch.manual_seed(1)
    d, sizes, mu, n = 10, [6, 4], 0.75, 3
    kind, shape = UPLOADS["ef-sign"], Shape(d, sizes, 1)

    state, sent, heavy, v = _ServerState(), torch.zeros(d), torch.zeros(d), torch.zeros(d)
    for _ in range(5):
        parsed = []
        for _i in range(n):
            arrays, _ = kind.encode(torch.randn(d), None, shape, torch.Generator(), [])
            parsed.append(
                kind.parse(arrays["signs"].data, {"scales": torch.from_numpy(arrays["scales"].numpy())}, shape)
            )
        # Execute: the strategy's aggregation, and FedAvgM's heavy ball v ← μ·v + Δ̄ on the same decoded mean
        mean = kind.total(parsed, shape)[0] / n
        step = quantized_delta(parsed, shape, state, kind=kind, how="mean", broadcast_bits=1, momentum=mu)
        sent += quantizers.dequantize(step.levels, 2, torch.tensor(step.scales), sizes)
        v = v * mu + mean
        heavy += v
    # Assert: M is heavy ball's v; the broadcasts plus what the error feedback holds are heavy ball's steps plus μ·v
    assert state.outer_momentum is not None and state.server_error is not None
    torch.testing.assert_close(state.outer_momentum, v, atol=1e-5, rtol=0)
    torch.testing.assert_close(sent + state.server_error, heavy + mu * v, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- a real federation
CLASSES, FEATURES, SPREAD = 8, 12, 0.5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _data(seed: int, classes: list[int], count: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian blobs around fixed class means (overlapping), ``count`` examples of each class."""
    means = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(99)) * SPREAD
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(classes).repeat_interleave(count)
    return means[y] + torch.randn(len(y), FEATURES, generator=g), y


app = ClientApp()
client = DLionClient(app, Net, loss_fn=lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1]))


@app.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    x, y = _data(pid, [2 * pid, 2 * pid + 1])  # two classes a client: the pathological split
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(pid))  # both classes in every batch
    x, y = x[order], y[order]
    return client.train(msg, context, [(x[i : i + 32], y[i : i + 32]) for i in range(0, len(y), 32)])


def _run(rounds: int = 4, **kw: object) -> tuple[str, float, DistributedLion]:
    strategy = DistributedLion(**(EF_SGD | {"local_steps": 10, "min_available_nodes": 4} | kw))  # type: ignore[arg-type]
    torch.manual_seed(0)
    result = strategy.start(LocalGrid(app, 4), ArrayRecord(Net().state_dict()), num_rounds=rounds)
    assert result.arrays is not None
    state = result.arrays.to_torch_state_dict()
    digest = f"{zlib.crc32(b''.join(v.numpy().tobytes() for v in state.values())):08x}"
    net = Net()
    net.load_state_dict(state)
    x, y = _data(1000, list(range(CLASSES)))
    with torch.no_grad():
        accuracy = float((net(x).argmax(1) == y).float().mean())
    return digest, accuracy, strategy


def test_off_and_mu_zero_reproduce_todays_run_bit_for_bit() -> None:
    # Execute: the ef-sgd mode with the options absent, at their off values, and on
    today, _, _ = _run()
    off, _, _ = _run(drift_correction="off", server_momentum=0.0)
    scaffold, _, _ = _run(drift_correction="scaffold")
    momentum, _, _ = _run(server_momentum=0.5)
    # Assert
    assert off == today
    assert scaffold != today and momentum != today


STEPS = 20


def test_a_two_class_split_federation_applies_the_correction() -> None:
    # Execute: 4 clients, 2 of 8 classes each, 25 rounds of 10 local SGD steps, without and with the correction
    plain = _run(25, local_steps=STEPS)
    corrected = _run(25, local_steps=STEPS, drift_correction="scaffold")
    # Assert: the same bytes a round (no extra payload; the config key only), and a model that learned
    for (_, accuracy, strategy), name in ((plain, "ef-sgd"), (corrected, "ef-sgd + scaffold")):
        up = sum(h["bytes-up"] for h in strategy.history)
        down = sum(h["bytes-down"] for h in strategy.history)
        print(f"{name}: accuracy {accuracy:.4f}, bytes up {up}, down {down}")
    up = [sum(h["bytes-up"] for h in run[2].history) for run in (plain, corrected)]
    assert abs(up[1] - up[0]) <= 0.001 * up[0]  # the same payloads (their deflated sizes vary by a few bytes)
    extra_down = sum(h["bytes-down"] for h in corrected[2].history) - sum(h["bytes-down"] for h in plain[2].history)
    print(f"extra bytes down per train message: {extra_down / (4 * 25):.1f}")
    assert 0 < extra_down <= 100 * 4 * 25  # the keys drift-correction and drift-limits (2 blocks), counted
    assert corrected[1] > 1.5 / CLASSES and all(h["applied"] for h in corrected[2].history)


def test_partial_participation_runs_and_the_limits_survive_a_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    # Execute: half the clients a round, so most sampled nodes missed the round before
    caplog.set_level(logging.INFO, logger="flower_dlion")
    _, accuracy, strategy = _run(8, drift_correction="scaffold", fraction_train=0.5, min_train_nodes=2)
    state = strategy.state.to_dict()
    # Assert: every round applied, the nodes that missed a round said so, the limits in the checkpoint
    assert all(h["applied"] for h in strategy.history) and accuracy > 1 / CLASSES
    assert any("a missed round" in r.getMessage() for r in caplog.records)
    assert ServerState.from_dict(state).drift_limits == strategy.state.drift_limits is not None
    del state["drift_limits"]  # a checkpoint written before drift correction
    assert ServerState.from_dict(state).drift_limits is None
