"""The study harness: every strategy end to end, the resumable sweep, the report."""

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

from flower_dlion.protocol import HELLO
from flower_dlion.strategies import DistributedLion
from flower_dlion.strategies.nodes import HELLO_TYPE
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.config import FEDAVG_FAMILY, STRATEGIES
from flower_dlion_app.data import load_fashion_mnist, partition_indices, to_tensor
from flower_dlion_app.metering import MeteredGrid
from flower_dlion_app.model import Net
from flower_dlion_app.server_app import run_federation, train_config
from flower_dlion_app.study import report, sweep
from tests.app.test_data_config import fake_fashion_dir

D = 281_034  # parameters of the shipped model


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("fashion")
    fake_fashion_dir(folder, n_train=80, n_test=40)
    return str(folder)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_runs_end_to_end_with_measured_bytes(strategy: str, fake_data: str, tmp_path: Path) -> None:
    # Prepare: 3 clients, 2 rounds on a tiny stand-in dataset (the math is tested elsewhere)
    cfg = {
        "strategy": strategy,
        "num-server-rounds": 2,
        "eval-every": 1,
        "batch-size": 8,
        "partitioner": "iid",
        "data-dir": fake_data,
        "results-dir": str(tmp_path),
        "lr": 0.001,
    }
    # Execute
    run_federation(LocalGrid(client_app, 3, run_config=cfg), cfg, save_model=False)
    # Assert: every client answered; bytes per reply = payload + headers (< 1 KB; FedAvg: 8 arrays, < 5 KB)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["num_replies"] for r in rows[1:]] == [3, 3] and all(r["num_errors"] == 0 for r in rows)
    payload = {"fp32": 4 * D, "sign": -(-D // 8), "tern": 4 * 8 + -(-D // 5), "2 x fp32": 2 * 4 * D}
    kind = {"global-lion": "fp32", "global-adamw": "fp32", "terngrad": "tern"}.get(strategy, "sign")
    kind = "fp32" if strategy in FEDAVG_FAMILY else kind
    kind = "2 x fp32" if strategy == "scaffold" else kind  # the model and Δcᵢ
    for r in rows[1:]:
        per_reply = r["bytes_up"] / 3  # our strategies' round 1 also carries one hello per node (< 600 B)
        headers = (10_000 if strategy == "scaffold" else 5000) if strategy in FEDAVG_FAMILY else 1000
        limit = payload[kind] + headers + (600 if r["round"] == 1 else 0)
        assert payload[kind] < per_reply < limit, (kind, per_reply)
        assert r["accuracy"] is not None and r["train_loss"] > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == strategy and summary["total_mb_up"] * 1e6 == sum(r["bytes_up"] for r in rows)


def test_meter_agrees_with_distributed_lions_own_byte_metrics(fake_data: str) -> None:
    cfg = {"batch-size": 8, "partitioner": "iid", "data-dir": fake_data}
    grid = MeteredGrid(LocalGrid(client_app, 3, run_config=cfg))
    strategy = DistributedLion(lr=0.001)
    arrays = ArrayRecord({k: Array(v.detach().numpy()) for k, v in Net().named_parameters()})
    strategy.start(grid, arrays, num_rounds=3, train_config=ConfigRecord({"batch-size": 8, "seed": 0}))
    train = [e for e in grid.exchanges if e.message_type == MessageType.TRAIN]
    assert [e.bytes_up for e in train] == [h["bytes-up"] for h in strategy.history]
    assert [e.bytes_down for e in train] == [h["bytes-down"] for h in strategy.history]
    (hello,) = [e for e in grid.exchanges if e.message_type == HELLO_TYPE]  # once, in round 1
    assert hello.num_replies == 3 and hello.bytes_up < 3 * 600 and hello.bytes_down < 3 * 500


class SlowGrid(LocalGrid):
    """LocalGrid whose replies become available only ``delay`` seconds after the push."""

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay, self.pulls, self.pushed_at = delay, 0, 0.0

    def push_messages(self, messages):
        self.pushed_at = time.monotonic()
        return [*super().push_messages(messages), None]  # a failed push, as Flower's Grid returns it

    def pull_messages(self, message_ids):
        self.pulls += 1
        if time.monotonic() - self.pushed_at < self.delay:
            return []
        return super().pull_messages([i for i in message_ids if i is not None])


def test_metered_grid_polls_every_interval_until_all_replies_or_the_timeout(fake_data: str) -> None:
    # Prepare: replies come 0.3 s after the push
    cfg = {"batch-size": 8, "partitioner": "iid", "data-dir": fake_data}
    grid = SlowGrid(client_app, 3, run_config=cfg, delay=0.3)
    metered = MeteredGrid(grid, poll_interval=0.05)
    hello = RecordDict({HELLO: ConfigRecord()})
    msgs = [Message(content=hello, dst_node_id=n, message_type=HELLO_TYPE) for n in grid.node_ids]
    # Execute
    t0 = time.monotonic()
    replies = metered.send_and_receive(msgs, timeout=10)
    waited = time.monotonic() - t0
    too_short = MeteredGrid(SlowGrid(client_app, 3, run_config=cfg, delay=5), poll_interval=0.05)
    t1 = time.monotonic()
    none = too_short.send_and_receive(
        [Message(content=hello, dst_node_id=n, message_type=HELLO_TYPE) for n in grid.node_ids], timeout=0.2
    )
    # Assert: all 3 replies (the failed push is not waited for), soon after they became available
    assert sorted(r.metadata.src_node_id for r in replies) == grid.node_ids
    assert 0.3 <= waited < 2.0 and 5 <= grid.pulls <= 30
    assert none == [] and 0.2 <= time.monotonic() - t1 < 2.0
    assert metered.exchanges[0].num_replies == 3 and too_short.exchanges[0].num_replies == 0
    with pytest.raises(ValueError, match="poll_interval must be > 0"):
        MeteredGrid(grid, poll_interval=0.0)


@pytest.mark.parametrize("local_batches", [0, 1])
def test_fedavg_round_is_the_weighted_mean_of_local_sgd_epochs(fake_data: str, local_batches: int) -> None:
    # Prepare (local_batches = 1: only the first minibatch of each epoch)
    cfg = {
        "strategy": "fedavg",
        "batch-size": 8,
        "partitioner": "dirichlet",
        "alpha": 1.0,
        "data-dir": fake_data,
        "lr": 0.05,
        "local-epochs": 2,
        "local-batches": local_batches,
    }
    torch.manual_seed(0)
    model = Net()
    arrays = ArrayRecord(model.state_dict())
    strategy = FedAvg(fraction_evaluate=0.0)
    # Execute
    result = strategy.start(
        LocalGrid(client_app, 2, run_config=cfg),
        arrays,
        num_rounds=1,
        train_config=train_config({**cfg, "seed": 0, "momentum": 0.9, "weight-decay": 0.0}),
    )
    # Assert: redo both clients' local SGD by hand and average by partition size
    ds = load_fashion_mnist(fake_data)
    parts = partition_indices(ds.y_train, partitioner="dirichlet", num_partitions=2, alpha=1.0, seed=0)
    locals_, sizes = [], []
    for pid, rows in enumerate(parts):
        local = Net()
        local.load_state_dict(arrays.to_torch_state_dict())
        opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
        rng = np.random.default_rng([0, pid, 1])
        x, y = to_tensor(ds.x_train[rows]), torch.from_numpy(ds.y_train[rows])
        for _ in range(2):
            order = torch.from_numpy(rng.permutation(rows.size))
            starts = range(0, rows.size, 8)
            for s in starts[:local_batches] if local_batches else starts:
                idx = order[s : s + 8]
                loss = torch.nn.functional.cross_entropy(local(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        locals_.append(local.state_dict())
        sizes.append(rows.size if not local_batches else min(8, rows.size))
    got = result.arrays.to_torch_state_dict()
    for name, value in got.items():
        want = sum(sd[name] * n for sd, n in zip(locals_, sizes, strict=True)) / sum(sizes)
        torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- sweep and report
STUDY = """
[study]
out = "out"
strategies = ["dlion-vote", "global-lion"]
num-clients = [2]
partitions = ["iid", "dirichlet-0.5"]
seeds = [0]
seeds-by-clients = {{"2" = [0, 1]}}

[common]
num-server-rounds = 2
eval-every = 1
batch-size = 8
data-dir = "{data}"

[strategy.global-lion]
lr = 0.001
"""


def test_sweep_resumes_after_an_interruption(fake_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a sweep of 8 cells that is interrupted during its third cell
    study = tmp_path / "study.toml"
    study.write_text(STUDY.format(data=fake_data))
    out, cells = sweep.load_study(study)
    assert len(cells) == 8 and [c.seed for c in cells] == [0] * 4 + [1] * 4  # first seeds first
    real_run_cell, calls, interrupt = sweep.run_cell, [], [True]

    def run_cell(cell: sweep.Cell, out: Path) -> dict:
        calls.append(cell.name)
        if interrupt[0] and len(calls) == 3:
            (out / "cells" / f"{cell.name}.json.tmp").write_text("{half a file")  # killed mid-write
            raise KeyboardInterrupt
        return real_run_cell(cell, out)

    monkeypatch.setattr(sweep, "run_cell", run_cell)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(study)
    assert sorted(p.name for p in (out / "cells").glob("*.json")) == sorted(f"{n}.json" for n in calls[:2])
    # Execute: run again
    calls.clear()
    interrupt[0] = False
    sweep.run_sweep(study)
    # Assert: only the 6 unfinished cells ran; every cell has its file
    assert len(calls) == 6 and not set(calls) & {c.name for c in cells[:2]}
    assert len(list((out / "cells").glob("*.json"))) == 8
    # A changed hyperparameter makes its cells stale: they run again, the others do not
    study.write_text(STUDY.format(data=fake_data).replace("lr = 0.001", "lr = 0.002"))
    calls.clear()
    sweep.run_sweep(study)
    assert sorted(calls) == sorted(c.name for c in cells if c.strategy == "global-lion")

    # The report: tables with mean ± std over the 2 seeds, one PNG per partition
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\nhand-written analysis\n\n<!-- BEGIN GENERATED -->\nold\n<!-- END GENERATED -->\ntail\n")
    text = report.write_report(study, md, tmp_path / "figures")
    records = report.load_cells(study)
    finals = [r["summary"]["final_accuracy"] for r in records if r["name"].startswith("dlion-vote_iid")]
    assert len(finals) == 2 and f"| dlion-vote | {report.mean_std(finals)} [2] |" in text
    written = md.read_text()
    assert "hand-written analysis" in written and written.endswith("tail\n") and "old" not in written
    assert (tmp_path / "figures" / "study-iid.png").stat().st_size > 10_000
    assert (tmp_path / "figures" / "study-dirichlet-0.5.png").is_file()


def test_a_sweep_goes_on_past_a_cell_that_stopped(
    fake_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: every cell's run replaced by a summary; the second one stopped (no accuracy)
    study = tmp_path / "study.toml"
    study.write_text(STUDY.format(data=fake_data))
    calls: list[str] = []

    def run_cell(cell: sweep.Cell, out: Path) -> dict:
        calls.append(cell.name)
        stopped = len(calls) == 2
        summary = {"eval_set": "test", "final_accuracy": None if stopped else 0.5, "total_mb_up": 1.0,
                   "wall_time_s": 1.0, "status": "stopped" if stopped else "completed"}  # fmt: skip
        return {"name": cell.name, "summary": summary}

    monkeypatch.setattr(sweep, "run_cell", run_cell)
    # Execute
    sweep.run_sweep(study)
    # Assert: all 8 cells ran, the stopped one reported as such
    printed = capsys.readouterr().out
    assert len(calls) == 8 and f"{calls[1]}: final test accuracy none (stopped)" in printed


def test_mean_std_and_partition_specs() -> None:
    assert report.mean_std([0.5, 0.7]) == "0.600 ± 0.141" and report.mean_std([0.25]) == "0.250"
    assert sweep.parse_partition("dirichlet-0.1") == {"partitioner": "dirichlet", "alpha": 0.1}
    assert sweep.parse_partition("pathological-2") == {"partitioner": "pathological", "classes-per-partition": 2}
    with pytest.raises(ValueError, match="partition 'dirichlet-x'"):
        sweep.parse_partition("dirichlet-x")


def test_a_variant_is_another_strategys_settings_with_overrides(tmp_path: Path) -> None:
    study = tmp_path / "study.toml"
    study.write_text(
        STUDY.format(data="/nowhere").replace('"global-lion"]', '"global-lion", "lion-slow"]')
        + '\n[variant.lion-slow]\nstrategy = "global-lion"\nbeta1 = 0.95\n'
    )
    _, cells = sweep.load_study(study)
    slow = [c for c in cells if c.label == "lion-slow"]
    assert len(slow) == 4 and all(c.name.startswith("lion-slow_") for c in slow)
    assert all(c.strategy == "global-lion" and c.run_config["strategy"] == "global-lion" for c in slow)
    assert all(c.run_config["lr"] == 0.001 and c.run_config["beta1"] == 0.95 for c in slow)  # base + override
    # A variant may run on fewer partitions than the study; one outside the study's is refused
    study.write_text(study.read_text() + 'partitions = ["dirichlet-0.5"]\n')
    _, cells = sweep.load_study(study)
    assert sorted(c.name for c in cells if c.label == "lion-slow") == [
        "lion-slow_dirichlet-0.5_n2_s0",
        "lion-slow_dirichlet-0.5_n2_s1",
    ]
    study.write_text(study.read_text().replace('partitions = ["dirichlet-0.5"]', 'partitions = ["shard-2"]'))
    with pytest.raises(ValueError, match=r"lion-slow's partitions \['shard-2'\] must be among the study's"):
        sweep.load_study(study)


def test_bytes_to_target_table_uses_the_first_evaluation_at_the_target() -> None:
    # Prepare: two methods on one partition, 2 clients; cumulative bytes at each evaluation
    def record(label: str, seed: int, accs: list[float], mb: list[float]) -> dict:
        evals = [
            {"round": i, "accuracy": a, "cum_bytes_up": m * 1e6, "cum_bytes_down": m * 1e6}
            for i, (a, m) in enumerate(zip(accs, mb, strict=True))
        ]
        return {
            "label": label,
            "partition": "iid",
            "num_clients": 2,
            "seed": seed,
            "evals": evals,
            "summary": {"final_accuracy": accs[-1]},
        }

    records = [
        record("fedavg", 0, [0.1, 0.7, 0.8], [0, 4, 8]),  # 2 clients: 4 and 8 MB per client
        record("fedavg", 1, [0.1, 0.8, 0.8], [0, 4, 8]),
        record("ef", 0, [0.1, 0.5, 0.8, 0.9], [0, 0.2, 0.4, 0.6]),
        record("ef", 1, [0.1, 0.6, 0.7, 0.7], [0, 0.2, 0.4, 0.6]),
    ]
    study = {"strategies": ["fedavg", "ef"], "partitions": ["iid"]}
    # Execute
    assert report.bytes_to_target(records[2], 0.8) == 0.4e6
    assert report.bytes_to_target(records[3], 0.8) is None
    text = report.target_table(records, study, "fedavg", fixed=(0.75,))
    # Assert: target 0.8 (FedAvg's mean final); FedAvg needs (8 + 4)/2 = 6 MB, ef 0.4 MB (1 of 2 seeds) → 15×
    assert "| fedavg | 6.00 [2/2] | 6.00 [2/2] |" in text
    assert "| ef | 0.40 [1/2, 15.0×] | 0.40 [1/2, 15.0×] |" in text


def test_time_model_is_the_documented_formula() -> None:
    from flower_dlion_app.study.timemodel import modelled_times

    # 2 clients; round 10: 4 s of wall time, 1 s of it the two evaluations; 20 MB down, 2 MB up in all
    record = {
        "num_clients": 2,
        "summary": {"eval_time_s": 1.0},
        "evals": [
            {"round": 0, "accuracy": 0.1, "wall_time_s": 0.5, "cum_bytes_down": 0, "cum_bytes_up": 0},
            {"round": 10, "accuracy": 0.8, "wall_time_s": 4.0, "cum_bytes_down": 20e6, "cum_bytes_up": 2e6},
        ],
    }
    (t0, _), (t10, acc) = modelled_times(record, down_bps=10e6, up_bps=1e6, rtt=0.05)
    assert t0 == 0.0
    # (4 − 2·0.5)/2 compute + 8·20e6/(2·10e6) down + 8·2e6/(2·1e6) up + 10·0.05 RTT
    assert t10 == pytest.approx(1.5 + 8.0 + 8.0 + 0.5) and acc == 0.8


def test_robustness_table_groups_by_the_swept_key() -> None:
    from flower_dlion_app.study.robustness import robustness_table

    def cell(label: str, f: float, acc: float, seed: int) -> dict:
        evals = [{"round": 10, "accuracy": acc, "cum_bytes_up": 1e6, "cum_bytes_down": 3e6}]
        summary = {"final_accuracy": acc}
        return {"label": label, "run_config": {"fail-fraction": f}, "summary": summary, "evals": evals,
                "num_clients": 2, "seed": seed}  # fmt: skip

    records = [cell("a", 0.0, 0.8, 0), cell("a", 0.0, 0.9, 1), cell("a", 0.3, 0.7, 0)]
    table = robustness_table(records, "fail-fraction", ["a"], target=0.75)
    assert "| method | fail-fraction = 0 | fail-fraction = 0.3 |" in table
    assert "| a | 0.850 ± 0.071; ≥ 0.75 at round 10, 2.0 MB/client [2/2] | 0.700; never ≥ 0.75 [0/1] |" in table


def _evaluated_cell(label: str, seed: int, accs: list[float], part: str = "iid", status: str = "completed") -> dict:
    """A 2-client cell record evaluated every round at ``accs``, with 2 MB per client a round (up + down)."""
    evals = [
        {"round": i, "accuracy": a, "cum_bytes_up": i * 1e6, "cum_bytes_down": i * 1e6} for i, a in enumerate(accs)
    ]
    summary = {"final_accuracy": accs[-1], "best_accuracy": max(accs), "rounds": len(accs) - 1, "status": status}
    return {"label": label, "partition": part, "num_clients": 2, "seed": seed, "evals": evals, "summary": summary}


def test_convergence_table_and_the_seed_spread_target() -> None:
    # Prepare: a reference with 2 seeds whose best accuracies are 0.9 and 0.8 (mean 0.85, std 0.0707)
    records = [
        _evaluated_cell("fedavg", 0, [0.1, 0.5, 0.9, 0.85]),
        _evaluated_cell("fedavg", 1, [0.1, 0.8, 0.7, 0.75]),
        _evaluated_cell("ef", 0, [0.1, 0.79, 0.8]),
    ]
    study = {"strategies": ["fedavg", "ef"], "partitions": ["iid"]}
    # Execute
    conv = report.convergence_table(records, study, last=1)
    targets = report.target_table(records, study, "fedavg", fixed=(), metric="best_accuracy")
    # Assert: best 0.9 (round 2) and 0.8 (round 1); the last round added nothing to either
    assert "| fedavg | 3 | 0.850 ± 0.071 | 2, 1 | 0.000 ± 0.000 |" in conv
    assert "| ef | 2 | 0.800 | 2 | 0.010 |" in conv
    # targets: the mean best 0.85 and its mean − 1 std 0.779; MB per client (2 clients, 2 MB a round) = round.
    # 0.85: only seed 0, at round 2; 0.779: seed 0 at round 2, seed 1 at round 1 (1.5); ef at round 1
    assert "to 0.850 (fedavg) | MB / client to 0.779 (its mean − 1 std) |" in targets
    assert "| fedavg | 2.00 [1/2] | 1.50 [2/2] |" in targets
    assert "| ef | – [0/1] | 1.00 [1/1, 1.5×] |" in targets


def test_the_report_names_every_cell_that_did_not_train_on_the_cpu() -> None:
    # Prepare: two CPU cells (one written before `ran_on` existed) and two on a GPU
    records = [
        {"name": "a_iid_n2_s0"},
        {"name": "a_iid_n2_s1", "ran_on": "cpu, torch 2.14.1"},
        {"name": "b_iid_n2_s1", "ran_on": "cuda (NVIDIA H200), torch 2.11.0"},
        {"name": "b_iid_n2_s0", "ran_on": "cuda (NVIDIA H200), torch 2.11.0"},
    ]
    # Execute
    line = report.where_ran(records)
    # Assert
    assert line == (
        "Clients trained on the CPU in 2 of 4 cells; on cuda (NVIDIA H200) in 2: `b_iid_n2_s0`, `b_iid_n2_s1`.\n"
    )


@pytest.mark.parametrize(
    "study_file", sorted((Path(__file__).parents[2] / "examples" / "studies").glob("*.toml")), ids=lambda p: p.name
)
def test_every_shipped_study_file_loads_with_valid_run_configs(study_file: Path) -> None:
    # Execute: load_study checks each cell's run config (read_config) as the sweep does before round 1
    _, cells = sweep.load_study(study_file)
    # Assert: cells exist and their names, the keys of the cell files, are unique
    names = [c.name for c in cells]
    assert names and len(names) == len(set(names))


def test_the_reference_target_is_the_mean_of_the_seeds_that_trained() -> None:
    # Prepare: FedAvg's seed 1 diverged (stopped) and seed 2 ran to the end at chance; seed 0 reached 0.8
    records = [
        _evaluated_cell("fedavg", 0, [0.1, 0.6, 0.8]),
        _evaluated_cell("fedavg", 1, [0.1, 0.15], status="stopped"),
        _evaluated_cell("fedavg", 2, [0.1, 0.12, 0.1]),
        _evaluated_cell("ef", 0, [0.1, 0.79, 0.81]),
    ]
    study = {"strategies": ["fedavg", "ef"], "partitions": ["iid"]}
    # Execute
    text = report.target_table(records, study, "fedavg", fixed=(), metric="best_accuracy")
    # Assert: the target is seed 0's 0.8 (not the mean of 0.8, 0.15 and 0.12), and the header says so
    assert [report.trained(r) for r in records] == [True, False, False, True]
    assert "(fedavg best accuracy 0.800, the 1 of 3 seeds that trained)" in text
    assert "| ef | 2.00 [1/1, 1.0×] |" in text


def test_bits_per_parameter_per_local_step() -> None:
    # Prepare: D-Lion with 100 local steps at 1.026 bits a round; FedAvg's 1 epoch over 60,000 / 8 images
    # in batches of 64 (117.19 steps a client on average) at 32 bits; with a 10,000-image holdout, 97.66
    def record(label: str, cfg: dict, bits: float) -> dict:
        summary = {"total_mb_up": 1.0, "total_mb_down": 1.0, "rounds": 10, "bytes_up_per_reply": bits / 8 * 1000,
                   "num_parameters": 1000, "final_accuracy": 0.5, "best_accuracy": 0.5}  # fmt: skip
        return {"label": label, "partition": "iid", "num_clients": 8, "seed": 0, "run_config": cfg,
                "summary": summary, "evals": []}  # fmt: skip

    ef = record("ef", {"strategy": "dlion-mean", "local-steps": 100}, 1.026)
    fedavg = record("fedavg", {"strategy": "fedavg", "batch-size": 64}, 32.0)
    held = record("fedavg-val", {"strategy": "fedavg", "holdout": 10000}, 32.0)
    capped = record("fedavg-5", {"strategy": "fedavg", "local-batches": 5, "local-epochs": 2}, 32.0)
    # Execute
    steps = [report.local_steps(r) for r in (ef, fedavg, held, capped)]
    study = {"strategies": ["ef", "fedavg"], "num-clients": [8], "partitions": ["iid"]}
    text = report.results_tables([ef, fedavg], study)
    # Assert
    assert steps == [100.0, 60000 / 8 / 64, 50000 / 8 / 64, 10.0]
    assert "| ef | 10 | 0.12 / 0.12 | 1.026 | 100 | 0.0103 |" in text
    assert "| fedavg | 10 | 0.12 / 0.12 | 32.000 | 117.2 | 0.2731 |" in text


def test_with_two_references_each_partition_takes_the_higher() -> None:
    # Prepare: FedAvg at two learning rates on two partitions; "fast" is higher on a, "slow" on b
    records = [
        _evaluated_cell("fast", 0, [0.1, 0.9], part="a"),
        _evaluated_cell("slow", 0, [0.1, 0.5, 0.8], part="a"),
        _evaluated_cell("fast", 0, [0.1, 0.6], part="b"),
        _evaluated_cell("slow", 0, [0.1, 0.5, 0.7], part="b"),
    ]
    study = {"strategies": ["fast", "slow"], "partitions": ["a", "b"]}
    # Execute
    text = report.target_table(records, study, ["slow", "fast"], fixed=(), metric="best_accuracy")
    # Assert
    assert "**a** (fast best accuracy 0.900)" in text and "**b** (slow best accuracy 0.700)" in text
    assert "| fast | – [0/1] |" in text and "| slow | 2.00 [1/1] |" in text.split("**b**")[1]
