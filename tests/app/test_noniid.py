"""Issue 30's methods: the FedSMU-style client (local SGD, one Lion step on the model change),
FedProx's proximal term, FedAdam / FedYogi with float32 downloads, and their run-config checks.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from flower_dlion import lion, quantizers
from flower_dlion.protocol import CONFIG
from flower_dlion.strategies import DistributedLion
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import read_config
from flower_dlion_app.data import load_fashion_mnist, partition_indices, sample_batch, to_tensor
from flower_dlion_app.model import Net, flat_gradient, flat_parameters, seeded_net
from flower_dlion_app.server_app import build_strategy, run_federation, train_config
from tests.app.test_data_config import fake_fashion_dir
from tests.states import load, node_at

D = 281_034


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("fashion")
    fake_fashion_dir(folder, n_train=80, n_test=40)
    return str(folder)


def iid_gradient(server_round: int, batch_size: int = 16):
    """The gradient of the one-client IID federation's minibatch of each local step of a round."""
    ds = load_fashion_mnist()
    rows = partition_indices(ds.y_train, partitioner="iid", num_partitions=1)[0]

    def gradient(x: torch.Tensor, step: int) -> torch.Tensor:
        batch = sample_batch(rows, batch_size, seed=0, partition_id=0, server_round=server_round, step=step)
        return flat_gradient(Net(), x, to_tensor(ds.x_train[batch]), torch.from_numpy(ds.y_train[batch]))[1]

    return gradient


def mean_config(lr: float, wd: float, k: int, **extra: object) -> dict:
    """Run config of a one-client IID federation of the mean with K local steps (batch 16)."""
    return {
        "partitioner": "iid",
        "batch-size": 16,
        "strategy": "dlion-mean",
        "lr": lr,
        "weight-decay": wd,
        "local-steps": k,
        **extra,
    }


def one_client(run_config: dict) -> tuple[DistributedLion, LocalGrid]:
    """The strategy of ``run_config`` and a LocalGrid of one node running the repository's ClientApp."""
    strategy = build_strategy(read_config(run_config))
    strategy.min_train_nodes = strategy.min_available_nodes = 1
    return strategy, LocalGrid(client_app, 1, run_config=run_config)


# ---------------------------------------------------------------- FedSMU-style client
def test_local_sgd_hand_computed_on_a_quadratic() -> None:
    # Prepare: f(x) = ½‖x‖², gradient x; η = 0.5, K = 2: x → x/2 → x/4
    x = torch.tensor([4.0, -8.0, 0.0])
    # Execute
    g = lion.local_sgd(x, lambda z, k: z.clone(), steps=2, lr=0.5)
    # Assert: g = x − x_K = [3, −6, 0], x untouched
    assert torch.equal(g, torch.tensor([3.0, -6.0, 0.0]))
    assert torch.equal(x, torch.tensor([4.0, -8.0, 0.0]))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        lion.local_sgd(x, lambda z, k: z, steps=0, lr=0.5)


def test_local_sgd_passes_each_step_its_index_and_the_moved_point() -> None:
    seen = []

    def gradient(z: torch.Tensor, k: int) -> torch.Tensor:
        seen.append((k, z.clone()))
        return torch.ones_like(z)

    g = lion.local_sgd(torch.zeros(2), gradient, steps=3, lr=0.25)
    assert [k for k, _ in seen] == [0, 1, 2]
    assert [z.tolist() for _, z in seen] == [[0.0, 0.0], [-0.25, -0.25], [-0.5, -0.5]]
    assert g.tolist() == [0.75, 0.75]


def test_one_fedsmu_client_is_one_lion_step_on_its_local_sgd_model_change() -> None:
    # Prepare: 1 client, K = 3 local SGD steps (η = 0.05) on its minibatches of round 1 and 2
    lr, wd, eta, k, b1, b2 = 0.01, 0.1, 0.05, 3, 0.9, 0.99
    run_config = mean_config(lr, wd, k, **{"local-optimizer": "sgd", "local-lr": eta})
    strategy, grid = one_client(run_config)
    arrays = ArrayRecord(seeded_net(0).state_dict())
    x, m = flat_parameters(seeded_net(0)), torch.zeros(D)
    for server_round in (1, 2):  # the second round uses the momentum of the first
        # Execute
        msgs = list(strategy.configure_train(server_round, arrays, ConfigRecord({"seed": 0}), grid))
        cfg = msgs[0].content[CONFIG]
        assert (cfg["local-optimizer"], cfg["local-lr"], cfg["local-steps"]) == ("sgd", eta, k)
        strategy.aggregate_train(server_round, grid.send_and_receive(msgs))
        state = load(grid.context(grid.node_ids[0]))
        assert state is not None
        # Assert: by hand, x_K by K SGD steps, g = x − x_K, δ = sign(β₁m + (1−β₁)g), m ← β₂m + (1−β₂)g,
        # and with n = 1 the mean is δ: x ← x − lr·(δ + wd·x) (one step's decay, not K's)
        x_local = x.clone()
        for step in range(k):
            x_local = x_local - eta * iid_gradient(server_round)(x_local, step)
        g = x - x_local
        mix = b1 * m + (1 - b1) * g
        want = x - lr * (torch.sign(mix) + wd * x)
        ties = mix == 0  # exact zeros (dead units): the client flips a seeded coin, the server moves ±lr
        torch.testing.assert_close(strategy.x[~ties], want[~ties], rtol=0, atol=1e-6)
        moved = (strategy.x - want)[ties].abs()
        torch.testing.assert_close(moved, torch.full_like(moved, lr), rtol=0, atol=1e-6)
        torch.testing.assert_close(state.m, b2 * m + (1 - b2) * g, rtol=1e-5, atol=1e-9)
        assert torch.equal(state.x, x)  # the replica is the server x it started the round from
        x, m = strategy.x.clone(), state.m.clone()


def test_local_sgd_with_ef_sign_sends_the_model_change_itself_compressed_with_error_feedback() -> None:
    # Prepare: 1 client, K = 3 local SGD steps (η = 0.05); the mean with a 1-bit broadcast, lr 1, no decay:
    # FedAvg's update x ← x − g, with g sent as a scaled sign and error feedback on both sides
    eta, k = 0.05, 3
    extra = {"local-optimizer": "sgd", "local-lr": eta, "upload": "ef-sign", "broadcast-bits": 1}
    strategy, grid = one_client(mean_config(1.0, 0.0, k, **extra))
    arrays = ArrayRecord(seeded_net(0).state_dict())
    x, client_error, server_error = flat_parameters(seeded_net(0)), torch.zeros(D), torch.zeros(D)
    for server_round in (1, 2):  # the second round adds both sides' errors of the first
        # Execute
        msgs = list(strategy.configure_train(server_round, arrays, ConfigRecord({"seed": 0}), grid))
        cfg = msgs[0].content[CONFIG]
        assert (cfg["local-optimizer"], cfg["upload"], cfg["local-steps"]) == ("sgd", "ef-sign", k)
        sizes = [p.numel() for p in seeded_net(0).parameters()]  # one scale per tensor
        strategy.aggregate_train(server_round, grid.send_and_receive(msgs))
        state = load(grid.context(grid.node_ids[0]))
        assert state is not None
        # Assert: by hand, g = x − x_K; the client sends q(g + e) = sⱼ·sign, per tensor sⱼ = mean|g + e|,
        # and keeps e ← g + e − q(g + e); the server (n = 1) sends q(that + e_s) and applies x ← x − Δ
        x_local = x.clone()
        for step in range(k):
            x_local = x_local - eta * iid_gradient(server_round)(x_local, step)
        w = (x - x_local) + client_error
        levels, scales = quantizers.quantize(w, sizes, 2)
        sent = quantizers.dequantize(levels, 2, scales, sizes)
        client_error = w - sent
        w_server = sent + server_error
        levels, scales = quantizers.quantize(w_server, sizes, 2)
        delta = quantizers.dequantize(levels, 2, scales, sizes)
        server_error = w_server - delta
        torch.testing.assert_close(strategy.x, x - delta, rtol=0, atol=1e-6)
        torch.testing.assert_close(state.error, client_error, rtol=0, atol=1e-6)
        assert not state.m.any()  # no Lion step: the momentum is never used
        assert torch.equal(state.x, x)  # the replica is the server x it started the round from
        x = strategy.x.clone()


def test_fedsmu_strategy_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="local_optimizer must be 'lion' or 'sgd', got 'adam'"):
        DistributedLion(local_optimizer="adam")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_optimizer='sgd' needs local_lr finite and > 0, got None"):
        DistributedLion(local_optimizer="sgd", local_steps=4)
    with pytest.raises(ValueError, match=r"local_optimizer='sgd' needs local_lr finite and > 0, got -0\.1"):
        DistributedLion(local_optimizer="sgd", local_lr=-0.1)
    with pytest.raises(ValueError, match=r"local_lr=0\.1 applies to local_optimizer='sgd' only"):
        DistributedLion(local_lr=0.1)
    with pytest.raises(ValueError, match="one of them and accumulate=1, got upload='sum'"):
        DistributedLion(aggregation="mean", local_optimizer="sgd", local_lr=0.1, upload="sum")
    # K SGD steps are one Lion step for the decay check: lr·wd·1 < 1 although lr·wd·K is not
    DistributedLion(local_optimizer="sgd", local_lr=0.1, local_steps=100, lr=0.5, weight_decay=0.1)


# ---------------------------------------------------------------- run config
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"local-optimizer": "adam"}, "'local-optimizer' must be one of \\('lion', 'sgd'\\), got 'adam'"),
        ({"local-optimizer": "sgd"}, "local-optimizer 'sgd' needs 'local-lr' > 0"),
        ({"local-lr": 0.1}, "'local-lr' = 0.1 applies to local-optimizer 'sgd' only"),
        ({"local-lr": -1.0, "local-optimizer": "sgd"}, "'local-lr' must be finite and >= 0, got -1.0"),
        (
            {"local-optimizer": "sgd", "local-lr": 0.1, "upload": "sum", "strategy": "dlion-mean"},
            "needs one of them and accumulate = 1, got upload='sum', accumulate=1",
        ),
        ({"strategy": "fedavg", "local-optimizer": "sgd", "local-lr": 0.1}, "apply to .* only, not to 'fedavg'"),
        (
            {"strategy": "fedprox", "proximal-mu": 0.0},
            "'proximal-mu' must be finite and > 0 \\(0 is FedAvg\\), got 0.0",
        ),
        ({"strategy": "fedavg", "proximal-mu": 0.1}, "'proximal-mu' applies to 'fedprox' only, not to 'fedavg'"),
        ({"strategy": "fedadam", "server-lr": 0.0}, "'server-lr' must be finite and > 0, got 0.0"),
        ({"strategy": "fedyogi", "server-tau": float("nan")}, "'server-tau' must be finite and > 0, got nan"),
        ({"strategy": "fedprox", "server-lr": 0.1}, "'server-lr' applies to \\('fedadam', 'fedyogi'\\) only"),
        ({"server-tau": 0.1}, "'server-tau' applies to \\('fedadam', 'fedyogi'\\) only, not to 'dlion-vote'"),
    ],
)
def test_new_run_config_keys_fail_with_name_value_and_range(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_config(changes)


def test_new_run_config_keys_reach_the_strategies() -> None:
    smu = build_strategy(
        read_config({"strategy": "dlion-mean", "local-optimizer": "sgd", "local-lr": 0.05, "local-steps": 7})
    )
    assert (smu.local_optimizer, smu.local_lr, smu.local_steps) == ("sgd", 0.05, 7)
    prox = build_strategy(read_config({"strategy": "fedprox", "proximal-mu": 0.3}))
    assert prox.proximal_mu == 0.3
    adam = build_strategy(read_config({"strategy": "fedadam", "server-lr": 0.02, "server-tau": 0.5, "beta1": 0.5}))
    assert (type(adam).__name__, adam.eta, adam.tau, adam.beta_1, adam.beta_2) == ("FedAdam", 0.02, 0.5, 0.5, 0.99)
    assert type(build_strategy(read_config({"strategy": "fedyogi"}))).__name__ == "FedYogi"


# ---------------------------------------------------------------- FedProx's client
def _client_model(fake_data: str, strategy_name: str, local_batches: int, **extra: float) -> dict[str, torch.Tensor]:
    cfg = {
        "strategy": strategy_name,
        "batch-size": 8,
        "partitioner": "iid",
        "data-dir": fake_data,
        "lr": 0.05,
        "momentum": 0.0,
        "weight-decay": 0.0,
        "local-batches": local_batches,
        **extra,
    }
    strategy = build_strategy(read_config(cfg))
    strategy.min_train_nodes = strategy.min_available_nodes = 1
    grid = LocalGrid(client_app, 1, run_config=cfg)
    arrays = ArrayRecord(seeded_net(0).state_dict())
    msgs = list(strategy.configure_train(1, arrays, train_config(read_config({**cfg, "seed": 0})), grid))
    (reply,) = grid.send_and_receive(msgs)
    return reply.content["arrays"].to_torch_state_dict()


def test_fedprox_client_adds_the_proximal_gradient_mu_times_the_distance(fake_data: str) -> None:
    # Prepare: plain SGD (no momentum), lr η, μ = 0.5. Step 1 starts at x (no pull); step 2 from w₁
    # differs from FedAvg's only by the proximal gradient μ·(w₁ − x)
    eta, mu = 0.05, 0.5
    x = seeded_net(0).state_dict()
    # Execute
    w1 = _client_model(fake_data, "fedavg", 1)
    w2_avg = _client_model(fake_data, "fedavg", 2)
    w2_prox = _client_model(fake_data, "fedprox", 2, **{"proximal-mu": mu})
    # Assert: w₂(prox) = w₂(avg) − η·μ·(w₁ − x), tensor by tensor; μ changes nothing in step 1
    w1_prox = _client_model(fake_data, "fedprox", 1, **{"proximal-mu": mu})
    assert all(torch.equal(w1_prox[n], w1[n]) for n in w1)
    for name in w1:
        want = w2_avg[name] - eta * mu * (w1[name] - x[name])
        torch.testing.assert_close(w2_prox[name], want, rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(w2_prox[n], w2_avg[n]) for n in w1)


# ---------------------------------------------------------------- FedAdam / FedYogi
@pytest.mark.parametrize("name", ["fedadam", "fedyogi"])
def test_adaptive_server_keeps_float32_so_every_download_is_the_fp32_model(
    name: str, fake_data: str, tmp_path: Path
) -> None:
    # Prepare: Flower's FedAdam/FedYogi step returns float64 arrays (2× the bytes); ours casts back
    cfg = {
        "strategy": name,
        "num-server-rounds": 3,
        "eval-every": 1,
        "batch-size": 8,
        "partitioner": "iid",
        "data-dir": fake_data,
        "results-dir": str(tmp_path),
        "lr": 0.01,
    }
    # Execute
    result = run_federation(LocalGrid(client_app, 2, run_config=cfg), cfg, save_model=False)
    # Assert: the same download every round (4 bytes a value plus headers), a float32 model that moved
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()][1:]
    downs = [r["bytes_down"] for r in rows]
    assert downs[0] == downs[1] == downs[2] and 2 * 4 * D < downs[0] < 2 * 4 * D + 10_000
    final = result.arrays.to_numpy_ndarrays()
    assert all(a.dtype.name == "float32" for a in final)
    start = [p.detach().numpy() for p in seeded_net(0).state_dict().values()]
    assert any((a != b).any() for a, b in zip(final, start, strict=True))


# ---------------------------------------------------------------- server (outer) Nesterov momentum
def test_server_momentum_is_nesterov_on_the_mean_before_the_one_bit_broadcast() -> None:
    # Prepare: 2 clients, mean of signs, 1-bit broadcast with error feedback, μ = 0.5, no decay
    from flower_dlion import quantizers

    from ..library.test_strategy import X0, StubGrid, first_round, signs_reply
    from .test_beyond import SIZES

    mu, lr = 0.5, 0.1
    strategy = DistributedLion(
        aggregation="mean", lr=lr, weight_decay=0.0, broadcast_bits=1, server_momentum=mu, downlink="chain"
    )
    rounds = [
        ([1, 1, -1, -1, 1, -1, 1, 1, -1, 1], [1, -1, -1, 1, 1, -1, -1, 1, -1, 1]),
        ([-1, 1, 1, -1, 1, 1, 1, -1, -1, 1], [1, 1, -1, -1, 1, -1, 1, 1, 1, 1]),
    ]
    sent = first_round(strategy, [1, 2])
    x, m, e = torch.from_numpy(X0.copy()), torch.zeros(10), torch.zeros(10)
    for server_round, (s1, s2) in enumerate(rounds, 1):
        if server_round > 1:
            msgs = strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), StubGrid([1, 2]))
            sent = {msg.metadata.dst_node_id: msg for msg in msgs}
        # Execute
        strategy.aggregate_train(server_round, [signs_reply(sent[1], s1, x), signs_reply(sent[2], s2, x)])
        # Assert: Δ = (s1 + s2)/2, M ← μ·M + Δ, the broadcast is the scaled sign of Δ + μ·M + e
        delta = (torch.tensor(s1, dtype=torch.float32) + torch.tensor(s2, dtype=torch.float32)) / 2
        m = m * mu + delta
        levels, scales = quantizers.ef_quantize_(delta + mu * m, e, SIZES, 2)
        x = x - lr * quantizers.dequantize(levels, 2, scales, SIZES)
        assert torch.equal(strategy.state.outer_momentum, m)
        torch.testing.assert_close(strategy.x, x, rtol=0, atol=1e-7)
    # … the momentum is part of the checkpoint
    restored = DistributedLion(
        aggregation="mean", lr=lr, weight_decay=0.0, broadcast_bits=1, server_momentum=mu, downlink="chain"
    )
    restored.load_state_dict(strategy.state_dict())
    assert torch.equal(restored.state.outer_momentum, m)


def test_server_momentum_is_untouched_by_a_round_without_valid_replies() -> None:
    from ..library.test_strategy import StubGrid, first_round, signs_reply

    strategy = DistributedLion(aggregation="mean", lr=0.1, broadcast_bits=1, server_momentum=0.9, downlink="chain")
    sent = first_round(strategy, [1, 2])
    strategy.aggregate_train(1, [signs_reply(sent[n], [1] * 10) for n in (1, 2)])
    m = strategy.state.outer_momentum.clone()
    msgs = {
        msg.metadata.dst_node_id: msg
        for msg in strategy.configure_train(2, ArrayRecord(), ConfigRecord(), StubGrid([1, 2]))
    }
    # Execute: both replies malformed (9 signs for 10 parameters)
    _, metrics = strategy.aggregate_train(2, [signs_reply(msgs[n], [1] * 9) for n in (1, 2)])
    # Assert
    assert metrics["num-rejected"] == 2 and torch.equal(strategy.state.outer_momentum, m)


def test_server_momentum_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"server_momentum must be in \[0, 1\) \(0: off\), got 1\.0"):
        DistributedLion(broadcast_bits=1, server_momentum=1.0)
    with pytest.raises(ValueError, match=r"server_momentum=0\.9 needs broadcast_bits >= 1"):
        DistributedLion(server_momentum=0.9)
    with pytest.raises(ValueError, match=r"run-config 'server-momentum' must be in \[0, 1\), got -0\.5"):
        read_config({"server-momentum": -0.5})
    with pytest.raises(ValueError, match="run-config 'server-momentum' needs 'broadcast-bits' >= 1"):
        read_config({"server-momentum": 0.5})
    with pytest.raises(ValueError, match=r"apply to .* only, not to 'fedavg'"):
        read_config({"strategy": "fedavg", "server-momentum": 0.5})
    built = build_strategy(read_config({"strategy": "dlion-mean", "broadcast-bits": 1, "server-momentum": 0.8}))
    assert built.server_momentum == 0.8


def test_server_momentum_run_resumed_from_a_checkpoint_reaches_the_same_x(tmp_path: Path) -> None:
    # Prepare: 4 rounds straight, and 2 rounds with a checkpoint then 2 more resumed from it
    # (new node ids; the clients' state from their files); half the clients sampled per round
    base = {
        "strategy": "dlion-mean",
        "broadcast-bits": 1,
        "server-momentum": 0.9,
        "partitioner": "iid",
        "batch-size": 16,
        "lr": 0.002,
        "eval-every": 2,
        "holdout": 1000,
        "fraction-train": 0.5,
        "checkpoint-every": 2,
    }
    straight = {
        **base,
        "num-server-rounds": 4,
        "results-dir": str(tmp_path / "a"),
        "client-state-dir": str(tmp_path / "sa"),
    }
    reference = run_federation(LocalGrid(client_app, 4, run_config=straight), straight, save_model=False)
    first = {
        **base,
        "num-server-rounds": 2,
        "results-dir": str(tmp_path / "b"),
        "client-state-dir": str(tmp_path / "sb"),
    }
    run_federation(LocalGrid(client_app, 4, run_config=first), first, save_model=False)
    # Execute
    more = {**first, "num-server-rounds": 4, "resume": str(tmp_path / "b" / "checkpoint.pt")}
    resumed = run_federation(LocalGrid(client_app, 4, run_config=more, first_node_id=9000), more, save_model=False)
    # Assert: bit for bit
    for name, arr in reference.arrays.items():
        np.testing.assert_array_equal(resumed.arrays[name].numpy(), arr.numpy(), err_msg=name)


# ---------------------------------------------------------------- drift control in the local steps
def test_local_proximal_term_pulls_each_local_lion_step_toward_the_rounds_x() -> None:
    # Prepare: 1 client, K = 3 local Lion steps, integer-sum upload (the server applies U exactly)
    lr, wd, k, mu = 0.01, 0.1, 3, 0.5
    gradient = iid_gradient(1)
    x0 = flat_parameters(seeded_net(0))
    run_config = mean_config(lr, wd, k, **{"upload": "sum", "local-proximal-mu": mu})
    strategy, grid = one_client(run_config)
    # Execute
    msgs = list(strategy.configure_train(1, ArrayRecord(seeded_net(0).state_dict()), ConfigRecord({"seed": 0}), grid))
    assert msgs[0].content[CONFIG]["local-proximal-mu"] == mu
    strategy.aggregate_train(1, grid.send_and_receive(msgs))
    # Assert: U from K Lion steps on g(x) + μ·(x − x₀); the server applied x₀ − lr·(U + K·wd·x₀)
    pulled = lion.local_steps_(
        x0.clone(),
        torch.zeros_like(x0),
        lambda x, step: gradient(x, step) + mu * (x - x0),
        steps=k,
        lr=lr,
        weight_decay=wd,
        beta1=0.9,
        beta2=0.99,
    )
    plain = lion.local_steps_(
        x0.clone(), torch.zeros_like(x0), gradient, steps=k, lr=lr, weight_decay=wd, beta1=0.9, beta2=0.99
    )
    expected = x0.clone()
    lion.apply_update_(expected, pulled, lr, wd * k)
    assert torch.equal(strategy.x, expected)
    assert not torch.equal(pulled, plain)  # the pull changed some of the K signs


def test_local_proximal_mu_is_checked() -> None:
    with pytest.raises(ValueError, match=r"local_proximal_mu must be finite and >= 0 \(0: off\), got -1\.0"):
        DistributedLion(local_steps=4, local_proximal_mu=-1.0)
    with pytest.raises(ValueError, match=r"local_proximal_mu=0\.5 needs local_steps > 1"):
        DistributedLion(local_proximal_mu=0.5)
    with pytest.raises(ValueError, match=r"run-config 'local-proximal-mu' = 0\.5 needs 'local-steps' > 1"):
        read_config({"local-proximal-mu": 0.5})
    with pytest.raises(ValueError, match=r"run-config 'local-proximal-mu' must be in \[0, 1e6\] \(0: off\), got inf"):
        read_config({"local-proximal-mu": float("inf"), "local-steps": 2})


# ---------------------------------------------------------------- stale momentum after missed rounds
@pytest.mark.parametrize(
    ("policy", "before", "after", "want"),
    [
        ("keep", 3, 7, [4.0, -2.0]),
        ("decay", 3, 7, [0.5, -0.25]),  # 3 missed rounds: β₂³ = 1/8
        ("decay", 3, 4, [4.0, -2.0]),  # sampled in consecutive rounds: nothing missed
        ("decay", None, 7, [4.0, -2.0]),  # a new node
        ("reset", 3, 5, [0.0, 0.0]),
    ],
)
def test_stale_momentum_decays_or_resets_by_the_rounds_missed(
    policy: str, before: int | None, after: int, want: list[float]
) -> None:
    from flower_dlion.clients.local_work import age_momentum
    from flower_dlion.round_records import RoundConfig

    state = node_at(np.zeros(2), after, torch.tensor([4.0, -2.0]))
    age_momentum(state, before, RoundConfig(server_round=1, version=after, beta1=0.9, beta2=0.5, stale_momentum=policy))
    assert state.m.tolist() == want


def test_unknown_stale_momentum_is_refused_and_bad_arguments_fail_early() -> None:
    from flower_dlion.round_records import ClientStateError, RoundConfig

    sent = ConfigRecord({"server-round": 2, "version": 1, "beta1": 0.9, "beta2": 0.99, "stale-momentum": "forget"})
    with pytest.raises(ClientStateError, match=r"node 5: the server sent stale-momentum = 'forget' \(one of"):
        RoundConfig.parse(sent, 5)
    with pytest.raises(ValueError, match="stale_momentum must be 'keep', 'decay' or 'reset', got 'forget'"):
        DistributedLion(stale_momentum="forget")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"'stale-momentum' must be one of \('keep', 'decay', 'reset'\)"):
        read_config({"stale-momentum": "forget"})
    assert build_strategy(read_config({"stale-momentum": "decay"})).stale_momentum == "decay"


def test_reset_momentum_in_a_sampled_federation_keeps_every_replica_on_the_servers_x(tmp_path: Path) -> None:
    # Prepare: 6 clients, 2 sampled per round, so most come back after missed rounds
    cfg = {
        "partitioner": "iid",
        "batch-size": 16,
        "lr": 0.002,
        "num-server-rounds": 6,
        "eval-every": 6,
        "holdout": 1000,
        "fraction-train": 0.34,
    }
    finals = {}
    for policy in ("keep", "reset"):
        run = {**cfg, "stale-momentum": policy, "results-dir": str(tmp_path / policy)}
        # Execute
        finals[policy] = run_federation(LocalGrid(client_app, 6, run_config=run), run, save_model=False)
        # Assert: every reply valid, no checksum mismatch, no resync
        rows = [json.loads(x) for x in (tmp_path / policy / "results.jsonl").read_text().splitlines()][1:]
        assert sum(r["checksum_mismatches"] for r in rows) == 0 and sum(r["full_syncs"] for r in rows) == 0
        assert all(r["num_replies"] == 2 for r in rows)
    # … and resetting the returning clients' momenta changed the run (same sampling, same batches)
    keep, reset = (finals[p].arrays.to_numpy_ndarrays() for p in ("keep", "reset"))
    assert any((a != b).any() for a, b in zip(keep, reset, strict=True))
