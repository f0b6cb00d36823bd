"""Bounded influence (issue 34): each float channel a client controls, its bound, and the attacks it is for."""

import json
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.common.serde import context_to_proto

from flower_dlion.bounds import clip_scales, median_momentum
from flower_dlion.protocol import CONFIG, MOMENTUM, SERVER_UPDATE
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.clients.attacks import LittleIsEnough, MomentumPoison, ScaleLie
from flower_dlion_app.config import read_config
from flower_dlion_app.server_app import run_federation

from .test_federation import RUN_CONFIG, initial_arrays

# ---------------------------------------------------------------- the rules, exactly


def test_scales_are_cut_to_the_lower_median_of_their_tensor() -> None:
    # Prepare: 3 clients × 2 tensors; the third lies about tensor 1
    scales = torch.tensor([[1.0, 2.0], [3.0, 4.0], [1000.0, 5.0]])
    # Execute
    clipped, count = clip_scales(scales)
    # Assert: medians (3, 4); the liar's 1000 → 3 and its 5 → 4
    assert clipped.tolist() == [[1.0, 2.0], [3.0, 4.0], [3.0, 4.0]] and count == 2
    # of two clients the lower median is the smaller: a liar can only claim the honest one's scale
    assert clip_scales(torch.tensor([[1.0, 5.0], [1e30, 2.0]]))[0].tolist() == [[1.0, 2.0], [1.0, 2.0]]


def test_synced_momentum_is_the_coordinatewise_median() -> None:
    big = 2.0**100  # ≈ 1.3·10³⁰, exact in float32
    momenta = [torch.tensor([1.0, -2.0, 3.0]), torch.tensor([-big, 0.0, 1.0]), torch.tensor([2.0, 5.0, big])]
    assert median_momentum(momenta).tolist() == [1.0, 0.0, 3.0]  # the liar's ±big never gets through
    four = [*momenta, torch.tensor([4.0, 1.0, 2.0])]  # even n: the mean of the two middle values
    assert median_momentum(four).tolist() == [1.5, 0.5, 2.5]
    assert median_momentum(momenta[:2]).tolist() == [(1.0 - big) / 2, -1.0, 2.0]  # 1 of 2: no majority to protect


# ---------------------------------------------------------------- the attacks, as a node sends them


def test_attackers_change_what_they_say_they_change() -> None:
    gen = torch.Generator().manual_seed(0)
    u = torch.tensor([3.0, -1.0, 0.5, -4.0, 2.0, -0.25])
    scales = {"scales": Array(np.array([0.5, 2.0], np.float32)), "signs": Array(np.zeros(1, np.float32))}
    lied = ScaleLie(1e30).arrays(dict(scales))
    np.testing.assert_array_equal(lied["scales"].numpy(), np.array([0.5e30, 2e30], np.float32))
    poisoned = MomentumPoison(1000.0).arrays({"momentum": Array(np.array([0.1, -3.0, 0.0], np.float32))})
    assert poisoned["momentum"].numpy().tolist() == [-1000.0, 1000.0, -0.0]
    assert ScaleLie(10.0).upload(u, gen).tolist() == (-u).tolist()
    # a little is enough: the three least certain coordinates (0.5, −1, −0.25) flipped, the rest honest
    assert LittleIsEnough().upload(u, gen).tolist() == [3.0, 1.0, -0.5, -4.0, 2.0, 0.25]


def test_attack_modes_are_checked_before_round_one() -> None:
    with pytest.raises(ValueError, match="byzantine-mode 'scale' lies about ef-sign scales: it needs upload"):
        read_config({"byzantine-mode": "scale"})
    with pytest.raises(ValueError, match="byzantine-mode 'momentum' poisons the synced momentum: set momentum-sync"):
        read_config({"byzantine-mode": "momentum"})
    with pytest.raises(ValueError, match="byzantine-mode 'little' applies to"):
        read_config({"byzantine-mode": "little", "strategy": "fedavg"})
    with pytest.raises(ValueError, match="'byzantine-mode' must be one of"):
        read_config({"byzantine-mode": "loud"})


# ---------------------------------------------------------------- a federation with a liar
EF_SIGN = {
    **RUN_CONFIG,
    "strategy": "dlion-mean",
    "local-steps": 5,
    "upload": "ef-sign",
    "broadcast-bits": 1,
    "lr": 0.001,
    "num-server-rounds": 8,
    "eval-every": 8,
    "holdout": 2000,
    "byzantine-fraction": 0.25,  # 1 of 4
}


def _final(tmp_path, **options: object) -> float:
    cfg = {**EF_SIGN, **options, "results-dir": str(tmp_path)}
    run_federation(LocalGrid(client_app, 4, run_config=cfg), cfg, save_model=False)
    return float(json.loads((tmp_path / "summary.json").read_text())["final_accuracy"])


@pytest.mark.slow
def test_a_liar_claiming_scales_of_1e30_does_no_more_than_a_flipper_with_honest_scales(tmp_path) -> None:
    # Execute: one of 4 clients uploads −U with honest scales; then the same with its scales × 10³⁰
    flip = _final(tmp_path / "flip", **{"byzantine-mode": "flip"})
    liar = _final(tmp_path / "liar", **{"byzantine-mode": "scale", "byzantine-scale": 1e30})
    # Assert: within 2 points (a liar cut to the median scale is a flipper whose scale is the median's)
    assert liar > 0.5 and abs(liar - flip) <= 0.02, (liar, flip)


# ---------------------------------------------------------------- the client refuses what is out of range


def _tampered(tamper: Callable[[Message], None], **strategy_options: object) -> tuple[LocalGrid, Message, bytes]:
    """Two rounds of a federation, then the round-3 message to node 1000 tampered with (and its state before)."""
    grid = LocalGrid(client_app, 2, run_config={**RUN_CONFIG, "device": "cpu"})
    strategy = DistributedLion(lr=0.01, weight_decay=0.1, **strategy_options)
    _, arrays = initial_arrays()
    for rnd in (1, 2):
        strategy.aggregate_train(
            rnd, grid.send_and_receive(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))
        )
    msg = next(m for m in strategy.configure_train(3, arrays, ConfigRecord(), grid) if m.metadata.dst_node_id == 1000)
    tamper(msg)
    return grid, msg, context_to_proto(grid.context(1000)).SerializeToString()


def _scales(msg: Message, value: float) -> None:
    cfg = msg.content[CONFIG]
    cfg["scales"] = [value] * (len(cfg["num-levels"]) * 8)  # Net has 8 tensors


def _levels(msg: Message) -> None:
    arr = msg.content[SERVER_UPDATE]["payload"]
    arr.data = b"\xff" * len(arr.data)  # 5 trits per byte hold 0…242: 255 is no level


def _config(key: str, value: object) -> Callable[[Message], None]:
    def tamper(msg: Message) -> None:
        msg.content[CONFIG][key] = value

    return tamper


CHAIN = {"downlink": "chain"}  # the chain downlink's Δs (the default, anchored, sends counts)


def _segment(key: str, value: float) -> Callable[[Message], None]:
    def tamper(msg: Message) -> None:
        msg.content[CONFIG][key] = [value]

    return tamper


def _trits_broken(msg: Message) -> None:
    assert msg.content[CONFIG]["segment-levels"] == [3]  # one Δ, as packed trits
    arr = msg.content[SERVER_UPDATE]["counts"]
    arr.data = arr.data[:30] + bytes([255]) + arr.data[31:]  # 5 trits a byte hold 0…242


def _old_server(tamper: Callable[[Message], None]) -> Callable[[Message], None]:
    """``tamper``, from a server that sends no ``payload-crc`` (the decoders' own range checks)."""

    def tampered(msg: Message) -> None:
        tamper(msg)
        msg.content[CONFIG].pop("payload-crc")

    return tampered


def _momentum(value: float) -> Callable[[Message], None]:
    def tamper(msg: Message) -> None:
        m = msg.content[MOMENTUM]["m"].numpy().copy()
        m[3] = value
        msg.content[MOMENTUM] = ArrayRecord({"m": Array(m)})

    return tamper


@pytest.mark.parametrize(
    ("tamper", "options", "reason"),
    [
        (lambda m: _scales(m, math.nan), CHAIN, "a Δ scale is nan, outside [0, 1e+06]: refused"),
        (lambda m: _scales(m, -1.0), CHAIN, "a Δ scale is -1.0, outside [0, 1e+06]: refused"),
        (lambda m: _scales(m, 1e30), CHAIN, "a Δ scale is 1e+30, outside [0, 1e+06]: refused"),
        (_config("scale-block", -4), CHAIN, "sent scale-block = -4 (an int in [0, 2147483648] allowed): refused"),
        (_config("scale-block", "8"), CHAIN, "sent scale-block = '8' (an int in [0, 2147483648] allowed): refused"),
        (_config("beta2", 5.0), CHAIN, "node 1000: the server sent beta2 = 5.0 (a finite number in [0, 1) allowed)"),
        (_config("beta1", math.nan), CHAIN, "the server sent beta1 = nan (a finite number in [0, 1) allowed)"),
        (_config("accumulate", -3), CHAIN, "the server sent accumulate = -3 (an int in [1, "),
        (_config("local-steps", 10**9), CHAIN, "= 1000000000 batches, more than this client's limit of 1000"),
        (_config("state-key", "../x"), CHAIN, "the server sent state-key = '../x' (a folder name of 1 to 64"),
        (_old_server(_levels), CHAIN, "Δ 1 of 1 does not decode"),
        (_levels, CHAIN, "node 1000, round 3: Δ 1 of 1 fails its checksum (CRC-32 "),
        (lambda m: m.content[CONFIG].__setitem__("lr", [-0.01]), CHAIN, "a Δ with lr -0.01 and weight decay"),
        (lambda m: m.content[CONFIG].__setitem__("lr", [math.inf]), CHAIN, "a Δ with lr inf and weight decay"),
        (lambda m: m.content[CONFIG].__setitem__("lr", [6.0]), CHAIN, "a Δ with lr 6.0 and weight decay 0.1 (finite,"),
        (lambda m: m.content[CONFIG].__setitem__("num-levels", [1]), CHAIN, "a Δ with 1 levels (2 to 65536"),
        (_segment("segment-decay", math.nan), {}, "a segment with decay nan and step 0.01"),
        (_segment("segment-decay", 1.5), {}, "a segment with decay 1.5 and step 0.01"),
        (_segment("segment-step", -1.0), {}, "step -1.0, 2 round(s) past its anchor (0.5**2 <= decay <= 1, step >= 0)"),
        (_segment("segment-decay", 1e-30), {}, "node 1000, round 3: a segment with decay 1e-30 and step 0.01, 2 round"),
        (_segment("segment-decay", 0.24), {}, "a segment with decay 0.24 and step 0.01, 2 round(s) past its anchor"),
        (_segment("segment-end", 5), {}, "node 1000, round 3: a packed Δ to version 5 from version 1"),
        (_old_server(_trits_broken), {}, "node 1000, round 3: trit5 byte above 242 (3^5 - 1): corrupted payload"),
        (_trits_broken, {}, "node 1000, round 3: count segment 1 of 1 fails its checksum (CRC-32 "),
        (_momentum(math.nan), {"momentum_sync_every": 2}, "the synced momentum has values outside ±1e+06"),
        (_momentum(1e30), {"momentum_sync_every": 2}, "the synced momentum has values outside ±1e+06"),
    ],
)
def test_a_server_message_out_of_range_is_refused_and_the_state_is_kept(tamper, options, reason) -> None:
    # Prepare
    grid, msg, before = _tampered(tamper, **options)
    # Execute
    (reply,) = grid.send_and_receive([msg])
    # Assert: an error reply naming the problem; the node's replica, momentum and error state untouched
    assert reply.has_error() and reason in reply.error.reason, reply.error.reason
    assert context_to_proto(grid.context(1000)).SerializeToString() == before


def test_a_full_model_with_a_nan_is_refused() -> None:
    # Prepare: node 1000 lost its state, so round 3 sends it the full model; one value is nan
    def tamper(msg: Message) -> None:
        x = msg.content[SERVER_UPDATE]["payload"].numpy().copy()
        x[7] = math.nan
        msg.content[SERVER_UPDATE] = ArrayRecord({"payload": Array(x)})

    grid = LocalGrid(client_app, 2, run_config={**RUN_CONFIG, "device": "cpu"})
    strategy = DistributedLion(lr=0.01)
    _, arrays = initial_arrays()
    msg = next(m for m in strategy.configure_train(1, arrays, ConfigRecord(), grid) if m.metadata.dst_node_id == 1000)
    tamper(msg)
    # Execute
    (reply,) = grid.send_and_receive([msg])
    # Assert
    assert reply.has_error() and "the full model has non-finite values: refused" in reply.error.reason
    assert not grid.context(1000).state


@pytest.mark.parametrize(("name", "fraction", "nodes", "attackers"), [("krum", 0.25, 8, 2), ("multikrum", 0.45, 20, 9)])
def test_krum_and_multikrum_are_told_how_many_attackers_there_are(name, fraction, nodes, attackers) -> None:
    # Prepare
    from flwr.serverapp.strategy import Krum, MultiKrum

    from flower_dlion_app.server_app import build_strategy

    from ..library.test_strategy import StubGrid

    strategy = build_strategy(read_config({"strategy": name, "byzantine-fraction": fraction}))
    # Execute
    strategy.configure_train(1, initial_arrays()[1], ConfigRecord(), StubGrid(list(range(1, nodes + 1))))
    # Assert: f = ⌊fraction · n + ½⌋; MultiKrum averages the n − f best
    assert isinstance(strategy, {"krum": Krum, "multikrum": MultiKrum}[name]) and type(strategy).__name__ != ""
    assert strategy.num_malicious_nodes == attackers
    if name == "multikrum":
        assert strategy.num_nodes_to_select == nodes - attackers
