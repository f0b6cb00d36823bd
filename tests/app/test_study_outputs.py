"""What a researcher gets from the study harness: reproducible cells, checked partitions, CSVs, plots, a report."""

import csv
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from flower_dlion_app.checkpoint import load_checkpoint, save_checkpoint
from flower_dlion_app.study import report, robustness, sweep, timemodel
from flower_dlion_app.study.coverage import cell_coverage, describe, partition_coverage
from flower_dlion_app.study.outputs import CSV_COLUMNS, cell_logging
from flower_dlion_app.study.plots import LINESTYLES, MARKERS, PALETTE, method_style, seed_band
from flower_dlion_app.study.runner import resume_keys
from tests.app.test_data_config import fake_fashion_dir, write_idx

STUDY = """
[study]
out = "{out}"
strategies = {strategies}
num-clients = {clients}
partitions = {partitions}
seeds = [0]
{extra}

[common]
num-server-rounds = {rounds}
eval-every = 1
batch-size = 32
data-dir = "{data}"
"""


def write_study(path: Path, data: str, **kw: object) -> Path:
    values = {"out": "out", "strategies": '["fedavg", "dlion-vote"]', "clients": "[2]", "partitions": '["iid"]',
              "extra": "", "rounds": 2, "data": data, **kw}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STUDY.format(**values))
    return path


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory: pytest.TempPathFactory) -> str:
    """400 training images, 40 of each class (labels 0, 1, …, 9, 0, 1, …), 40 test images."""
    folder = tmp_path_factory.mktemp("fashion400")
    fake_fashion_dir(folder, n_train=400, n_test=40)
    return str(folder)


@pytest.fixture(scope="module")
def swept(fake_data: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A study of 2 real cells (FedAvg and D-Lion vote, 2 clients, 2 rounds) run with one worker."""
    study = write_study(tmp_path_factory.mktemp("one") / "study.toml", fake_data)
    sweep.run_sweep(study, workers=1)
    return study


# ---------------------------------------------------------------- a cell's result does not depend on --workers
def test_a_cells_result_is_the_same_bit_for_bit_with_one_or_two_workers(
    swept: Path, fake_data: str, tmp_path: Path
) -> None:
    # Prepare: the same study in another folder; this process runs torch with 2 threads
    torch.set_num_threads(2)
    two = write_study(tmp_path / "study.toml", fake_data)
    # Execute: two workers (each cell in a spawned process); the module's sweep ran with one
    sweep.run_sweep(two, workers=2)
    # Assert: same accuracies, losses, bytes and final model, every bit; 1 thread recorded; ours given back
    assert torch.get_num_threads() == 2
    for name in ("fedavg_iid_n2_s0", "dlion-vote_iid_n2_s0"):
        a, b = (json.loads((s.parent / "out" / "cells" / f"{name}.json").read_text()) for s in (swept, two))
        for record in (a, b):
            for row in record["evals"]:
                row.pop("wall_time_s")
        assert a["evals"] == b["evals"] and len(a["evals"]) == 3  # rounds 0, 1, 2: floats compared exactly
        assert a["summary"]["final_accuracy"] == b["summary"]["final_accuracy"]
        assert a["final_model_sha256"] == b["final_model_sha256"] and len(a["final_model_sha256"]) == 64
        assert a["threads"] == b["threads"] == 1
        csv_a, csv_b = (_csv(s.parent / "out" / "cells" / f"{name}.csv") for s in (swept, two))
        for row in csv_a + csv_b:
            row.pop("wall_time_s")
        assert csv_a == csv_b


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_every_cell_writes_its_rounds_as_csv_beside_its_json(swept: Path) -> None:
    # Execute
    cells = swept.parent / "out" / "cells"
    record = json.loads((cells / "dlion-vote_iid_n2_s0.json").read_text())
    rows = _csv(cells / "dlion-vote_iid_n2_s0.csv")
    header = (cells / "dlion-vote_iid_n2_s0.csv").read_text().splitlines()[0].split(",")
    # Assert: the documented columns first, then the strategy's own metrics; one row per round
    assert tuple(header[: len(CSV_COLUMNS)]) == CSV_COLUMNS and "tie_fraction" in header
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert {(r["cell"], r["label"], r["strategy"], r["partition"], r["num_clients"], r["seed"]) for r in rows} == {
        ("dlion-vote_iid_n2_s0", "dlion-vote", "dlion-vote", "iid", "2", "0")
    }
    assert rows[0]["train_loss"] == "" and rows[0]["bytes_up"] == "0"  # round 0: the untrained model
    for row, ev in zip(rows, record["evals"], strict=True):  # every round was evaluated (eval-every 1)
        assert float(row["accuracy"]) == ev["accuracy"] and float(row["loss"]) == ev["loss"]
        assert int(row["cum_bytes_up"]) == ev["cum_bytes_up"] and int(row["cum_bytes_down"]) == ev["cum_bytes_down"]
    assert int(rows[1]["bytes_up"]) + int(rows[2]["bytes_up"]) == record["evals"][-1]["cum_bytes_up"]


def test_a_resumed_sweep_reruns_a_cell_of_another_thread_count(
    fake_data: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: 4 cells; one file from 2 threads, one from before thread counts were recorded, one from 1 thread
    study = write_study(tmp_path / "study.toml", fake_data, strategies='["fedavg", "dlion-vote"]', clients="[2, 3]")
    out, cells = sweep.load_study(study)
    (out / "cells").mkdir(parents=True)
    for cell, extra in [(cells[0], {"threads": 2}), (cells[1], {}), (cells[2], {"threads": 1})]:
        record = {"key": cell.key(), "name": cell.name, "num_clients": cell.num_clients, **extra}
        (out / "cells" / f"{cell.name}.json").write_text(json.dumps(record))
    calls: list[str] = []

    def run_cell(cell: sweep.Cell, out: Path) -> dict:
        calls.append(cell.name)
        return {"name": cell.name, "summary": {"eval_set": "test", "final_accuracy": 0.5, "total_mb_up": 1.0,
                                               "wall_time_s": 1.0}}  # fmt: skip

    monkeypatch.setattr(sweep, "run_cell", run_cell)
    # Execute
    sweep.run_sweep(study)
    # Assert: the 2-thread cell and the missing one ran; the unrecorded one is kept, and said so
    printed = capsys.readouterr().out
    assert calls == [cells[0].name, cells[3].name]
    assert "4 cells, 2 done, 2 to run" in printed and "(1 torch thread per cell, 1 worker)" in printed
    assert "1 done cells were written before the thread count was recorded: kept as done" in printed
    assert "1 cells ran with another thread count than 1: they run again" in printed
    assert [r["name"] for r in report.load_cells(study)] == [cells[1].name, cells[2].name]


def test_the_threads_key_sets_every_cells_thread_count(fake_data: str, tmp_path: Path) -> None:
    study = write_study(tmp_path / "study.toml", fake_data, extra="threads = 3")
    _, cells = sweep.load_study(study)
    assert [c.threads for c in cells] == [3, 3] and not any(c.allow_empty for c in cells)


# ---------------------------------------------------------------- a cell killed mid-run goes on from its checkpoint
KILLED_SWEEP = """
import functools, os, signal, sys
from pathlib import Path
import flower_dlion.testing
from flower_dlion_app.study import sweep
def hook(node_id, reply):
    if reply.metadata.group_id == "4":  # killed in round 4, after a client trained (and saved its state)
        os.kill(os.getpid(), signal.SIGKILL)
    return reply
flower_dlion.testing.LocalGrid = functools.partial(flower_dlion.testing.LocalGrid, reply_hook=hook)
sweep.run_sweep(Path(sys.argv[1]))
"""


def test_a_cell_killed_mid_run_goes_on_from_its_checkpoint_to_the_same_model(
    fake_data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a 5-round cell of the SGD mode with error feedback and server momentum (client and server
    # state), run without checkpoints, with one every 2 rounds, and with them but killed (SIGKILL) in round 4
    mode = """
[strategy.dlion-mean]
local-optimizer = "sgd"
local-steps = 2
local-lr = 0.1
upload = "ef-sign"
lr = 1.0
weight-decay = 0.0
broadcast-bits = 1
server-momentum = 0.5
"""
    kw = {"strategies": '["dlion-mean"]', "rounds": 5}
    studies = {
        run: write_study(tmp_path / run / "study.toml", fake_data, extra=f"checkpoint-every = {every}", **kw)
        for run, every in (("plain", 0), ("straight", 2), ("killed", 2))
    }
    for study in studies.values():
        study.write_text(study.read_text() + mode)
    assert [c.checkpoint_every for c in sweep.load_study(studies["killed"])[1]] == [2]
    sweep.run_sweep(studies["plain"])
    sweep.run_sweep(studies["straight"])
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-c", KILLED_SWEEP, str(studies["killed"])], env=env, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    work = tmp_path / "killed" / "out" / "work" / "dlion-mean_iid_n2_s0"
    assert load_checkpoint(work / "checkpoint.pt")["round"] == 2 and not (work.parent.parent / "cells").exists()
    capsys.readouterr()
    # Execute: the sweep again
    sweep.run_sweep(studies["killed"])
    # Assert: it went on after round 2, to the uninterrupted run's rows and model, bit for bit; nothing left
    assert f"resuming from {work / 'checkpoint.pt'} after round 2" in capsys.readouterr().out
    plain, straight, killed = (
        json.loads((s.parent / "out" / "cells" / "dlion-mean_iid_n2_s0.json").read_text()) for s in studies.values()
    )
    for record in (plain, straight, killed):
        for row in record["evals"]:
            row.pop("wall_time_s")
    assert straight["evals"][:3] == killed["evals"][:3] and [r["round"] for r in killed["evals"]] == [0, 1, 2, 3, 4, 5]
    learned = [[(r["accuracy"], r["loss"], r["train_loss"]) for r in c["evals"]] for c in (straight, killed)]
    assert learned[0] == learned[1]
    # the resumed server greets its nodes again in round 3 (a hello each): counted, once
    extra = {(b["cum_bytes_up"] - a["cum_bytes_up"], b["cum_bytes_down"] - a["cum_bytes_down"])
             for a, b in zip(straight["evals"][3:], killed["evals"][3:], strict=True)}  # fmt: skip
    assert len(extra) == 1 and min(extra.pop()) > 0
    assert plain["final_model_sha256"] == straight["final_model_sha256"] == killed["final_model_sha256"]
    assert killed["summary"]["resumed_from_round"] == 2 and straight["summary"]["resumed_from_round"] is None
    assert sorted(p.name for p in work.iterdir()) == ["results.jsonl", "summary.json"]
    # … and checkpoints change nothing learned; each train message names the rounds of the clients' state files
    for a, b in zip(plain["evals"], straight["evals"], strict=True):
        assert (a["accuracy"], a["loss"], a["cum_bytes_up"]) == (b["accuracy"], b["loss"], b["cum_bytes_up"])
        assert (
            0 <= b["cum_bytes_down"] - a["cum_bytes_down"] <= 40 * 2 * a["round"]
        )  # measured: 19 B, 37 B after a checkpoint


def test_only_a_checkpoint_of_the_same_run_config_and_threads_is_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: a cell and a checkpoint in its work folder
    cell = sweep.Cell("c", "dlion-vote", "dlion-vote", 2, "iid", 0, {"strategy": "dlion-vote", "lr": 0.001},
                      checkpoint_every=5)  # fmt: skip
    work = tmp_path / "work" / "c"
    state = {"checkpoint-every": 5, "client-state-dir": str(work / "client-state")}
    assert resume_keys(cell, work) == state  # nothing to resume: an empty folder and the cell's stamp
    save_checkpoint(work / "checkpoint.pt", {"round": 3})
    # Execute / Assert: the same cell resumes it
    assert resume_keys(cell, work) == {**state, "resume": str(work / "checkpoint.pt")}
    assert "c: resuming from" in capsys.readouterr().out
    # … another thread count, another run config, or an unreadable file: said, and the cell starts over
    for other in (dataclasses.replace(cell, threads=2), dataclasses.replace(cell, run_config={"lr": 0.002})):
        save_checkpoint(work / "checkpoint.pt", {"round": 3})
        assert resume_keys(other, work) == state
        assert "not resuming from" in capsys.readouterr().out and list(work.iterdir()) == [work / "cell.json"]
    resume_keys(cell, work)  # the cell's own stamp again
    (work / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert resume_keys(cell, work) == state and "not a readable flower-dlion checkpoint" in capsys.readouterr().out
    assert resume_keys(dataclasses.replace(cell, checkpoint_every=0), work) == {}


def test_flowers_strategies_have_no_checkpoints_and_ours_default_to_every_10_rounds(tmp_path: Path) -> None:
    study = write_study(tmp_path / "study.toml", "/nowhere", strategies='["fedavg", "dlion-vote", "global-lion"]')
    _, cells = sweep.load_study(study)
    work = tmp_path / "w"
    assert {c.strategy: c.checkpoint_config(work) for c in cells} == {
        "fedavg": {},
        "dlion-vote": {"checkpoint-every": 10, "client-state-dir": str(work / "client-state")},  # clients' state
        "global-lion": {"checkpoint-every": 10},  # stateless clients
    }


# ---------------------------------------------------------------- bad study files say key, value and what is allowed
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("threads = 0", "[study] threads = 0: expected torch's CPU threads in every cell: an integer >= 1 (default 1)"),
        ("threads = 1.5", "[study] threads = 1.5: expected torch's CPU threads in every cell: an integer >= 1"),
        ('allow-empty = "no"', '[study] allow-empty = "no": expected whether to run cells whose partitions leave a '
                               "class or a client without data: true or false (default false)"),
        ("allow_empty = true", "[study] allow_empty = true: unknown key; allowed: out, strategies, num-clients, "
                               "partitions, seeds, seeds-by-clients, threads, allow-empty, checkpoint-every"),
        ("checkpoint-every = -1", "[study] checkpoint-every = -1: expected rounds between a cell's checkpoints"),
        ('seeds-by-clients = {"8" = 1}', '[study] seeds-by-clients = {"8": 1}: expected a table from a number of '
                                         "clients to a list of integer seeds"),
    ],
)  # fmt: skip
def test_a_bad_study_value_names_the_key_the_value_and_what_is_allowed(
    extra: str, message: str, tmp_path: Path
) -> None:
    study = write_study(tmp_path / "study.toml", "/nowhere", extra=extra)
    with pytest.raises(sweep.StudyError) as err:
        sweep.load_study(study)
    assert str(err.value).startswith(f"{study}: {message}")


def test_bad_grid_values_and_tables_are_refused(tmp_path: Path) -> None:
    study = write_study(tmp_path / "study.toml", "/nowhere", clients="[0, 2]")
    with pytest.raises(sweep.StudyError, match=r"\[study\] num-clients = \[0, 2\]: expected a non-empty list of num"):
        sweep.load_study(study)
    study = write_study(tmp_path / "study.toml", "/nowhere", partitions='["dirichlet"]')
    with pytest.raises(sweep.StudyError, match=r"partitions = \[\"dirichlet\"\]: partition 'dirichlet': expected iid"):
        sweep.load_study(study)
    study.write_text(study.read_text().replace('["dirichlet"]', '["iid"]') + "\n[strategies.fedavg]\nlr = 0.1\n")
    with pytest.raises(sweep.StudyError, match=r"unknown tables \['strategies'\]; a study file has \[study\]"):
        sweep.load_study(study)
    with pytest.raises(sweep.StudyError, match="--workers 0: expected an integer >= 1"):
        sweep.run_sweep(study, workers=0)


# ---------------------------------------------------------------- partitions that leave a class or a client out
def test_partition_coverage_names_missing_classes_and_empty_clients() -> None:
    labels = np.array([0, 1, 2, 0, 1, 2])
    check = partition_coverage(labels, [np.array([0, 3]), np.array([1]), np.array([], dtype=np.int64)], [0, 1, 2, 3])
    assert check == {"client_sizes": [2, 1, 0], "missing_classes": [2, 3], "empty_clients": [2]}
    assert describe(check) == "no client has classes 2, 3 and client 2 got no data"
    assert describe({"missing_classes": [9], "empty_clients": []}) == "no client has class 9"
    assert describe({"missing_classes": [], "empty_clients": []}) == ""


def test_the_check_uses_the_partitions_the_clients_train_on(fake_data: str, tmp_path: Path) -> None:
    # pathological-1: client i gets class i mod 10 only (flwr-datasets' first-deterministic assignment)
    patho = {"partitioner": "pathological", "classes-per-partition": 1, "data-dir": fake_data}
    # 3 clients: classes 0, 1, 2 (40 images each); nobody has 3 … 9
    assert cell_coverage(patho, 3) == {"client_sizes": [40, 40, 40], "missing_classes": [3, 4, 5, 6, 7, 8, 9],
                                       "empty_clients": []}  # fmt: skip
    # 12 clients: clients 10 and 11 share classes 0 and 1 with clients 0 and 1 (20 images each)
    assert cell_coverage(patho, 12)["client_sizes"] == [20, 20] + [40] * 8 + [20, 20]
    assert cell_coverage(patho, 12)["missing_classes"] == []
    # The holdout (the server's validation images, the last ones) is not the clients'
    assert cell_coverage({"partitioner": "iid", "data-dir": fake_data, "holdout": 100}, 2)["client_sizes"] == [150, 150]


def test_a_study_refuses_a_partition_that_leaves_a_class_out_before_anything_runs(
    fake_data: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare: pathological-1 on 3 clients leaves classes 3 … 9 out; on 12 clients it does not
    kw = {"strategies": '["fedavg"]', "clients": "[3, 12]", "partitions": '["iid", "pathological-1"]', "rounds": 1}
    study = write_study(tmp_path / "study.toml", fake_data, **kw)
    want = (
        f"{study}: 1 cell(s) would train on partitions that leave data out (set allow-empty = true in [study] to "
        "run them anyway, or change the partition or the number of clients):\n"
        "  - partition pathological-1 on 3 clients, seed 0: no client has classes 3, 4, 5, 6, 7, 8, 9; "
        "cells: fedavg_pathological-1_n3_s0"
    )
    # Execute / Assert: the dry run and the sweep refuse it, naming the cell; nothing ran
    for dry_run in (True, False):
        with pytest.raises(sweep.StudyError) as err:
            sweep.run_sweep(study, dry_run=dry_run)
        assert str(err.value) == want
    assert not (tmp_path / "out").exists()
    assert sweep.main([str(study), "--dry-run"]) == 2
    assert capsys.readouterr().err == f"error: {want}\n"
    # run_cell on its own refuses it too
    _, cells = sweep.load_study(study)
    (refused,) = [c for c in cells if c.name == "fedavg_pathological-1_n3_s0"]
    with pytest.raises(sweep.StudyError, match="no client has classes 3, 4, 5, 6, 7, 8, 9"):
        sweep.run_cell(refused, tmp_path / "out")


def test_a_partitioning_flwr_datasets_cannot_make_is_refused_naming_the_cell(tmp_path: Path) -> None:
    # Prepare: 20 images for 25 clients (iid), and a class with one image for 2 clients (pathological-1 on 11)
    data = tmp_path / "tiny"
    fake_fashion_dir(data, n_train=20, n_test=10)
    study = write_study(tmp_path / "study.toml", str(data), strategies='["fedavg"]', clients="[25]")
    # Execute / Assert
    with pytest.raises(sweep.StudyError) as err:
        sweep.run_sweep(study, dry_run=True)
    assert str(err.value).startswith(
        f"{study}: cell fedavg_iid_n25_s0: partition iid on 25 clients cannot be made: Index 20 out of range"
    )
    skewed = tmp_path / "skewed"  # another folder: the data of a folder is loaded once per process
    fake_fashion_dir(skewed, n_train=20, n_test=10)
    write_idx(skewed / "train-labels-idx1-ubyte.gz", np.array([0] + [c for c in range(1, 10) for _ in range(2)] + [1]))
    kw = {"strategies": '["fedavg"]', "clients": "[11]", "partitions": '["pathological-1"]'}
    study = write_study(tmp_path / "study.toml", str(skewed), **kw)
    with pytest.raises(
        sweep.StudyError,
        match="cell fedavg_pathological-1_n11_s0: partition pathological-1 on 11 "
        "clients cannot be made: Label: 0 is needed to be assigned to more",
    ):
        sweep.run_sweep(study, dry_run=True)  # fmt: skip


def test_allow_empty_runs_it_and_the_cell_and_the_report_say_what_was_missing(fake_data: str, tmp_path: Path) -> None:
    # Prepare
    kw = {"strategies": '["fedavg"]', "clients": "[3]", "partitions": '["pathological-1"]', "rounds": 1}
    study = write_study(tmp_path / "study.toml", fake_data, extra="allow-empty = true", **kw)
    # Execute
    (record,) = sweep.run_sweep(study)
    records = report.load_cells(study)
    # Assert
    assert record["partition_check"] == {"client_sizes": [40, 40, 40], "missing_classes": [3, 4, 5, 6, 7, 8, 9],
                                         "empty_clients": []}  # fmt: skip
    assert report.setup_notes(records) == (
        "torch CPU threads per cell: 1 in 1 cells.\n\n"
        "Partitions that left data out, as recorded when each cell was set up:\n"
        "- pathological-1, n = 3, seed 0: no client has classes 3, 4, 5, 6, 7, 8, 9 (1 cells: "
        "`fedavg_pathological-1_n3_s0`)\n"
    )


# ---------------------------------------------------------------- the report: where it writes, what it shows
def test_the_report_writes_into_the_studys_own_folder_unless_told(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: run from a folder with a docs/RESULTS.md that must stay untouched
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "RESULTS.md").write_text("mine\n")
    out = swept.parent / "out"
    # Execute
    assert report.main([str(swept)]) == 0
    # Assert: <out>/report.md, <out>/figures/, links relative to the report; docs/ untouched
    text = (out / "report.md").read_text()
    assert "![iid](figures/study-iid.png)" in text and (out / "figures" / "study-iid.png").stat().st_size > 10_000
    assert (tmp_path / "docs" / "RESULTS.md").read_text() == "mine\n" and not (tmp_path / "docs" / "figures").exists()
    assert "torch CPU threads per cell: 1 in 2 cells.\n" in text
    assert "Every checked cell's partitions gave each client data and each class a client." in text
    assert "| strategy | rounds | n = 2: MB per client, up / down | up bits / param / round (per client) |" in text
    # Named places: the image link follows --figures, relative to --out's folder
    assert report.main([str(swept), "--out", "docs/RESULTS.md", "--figures", "pics"]) == 0
    written = (tmp_path / "docs" / "RESULTS.md").read_text()
    assert written.startswith("mine\n") and "![iid](../pics/study-iid.png)" in written
    assert (tmp_path / "pics" / "study-iid.png").is_file()


def test_robustness_and_time_model_write_into_the_studys_own_folder_unless_told(
    swept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    out = swept.parent / "out"
    assert robustness.main([str(swept), "--key", "lr", "--section", "lr", "--bytes"]) == 0
    assert "<!-- BEGIN GENERATED lr -->" in (out / "report.md").read_text()
    assert "in brackets: MB per client over the whole run, up + down" in (out / "report.md").read_text()
    args = [str(swept), "--labels", "fedavg,dlion-vote", "--clients", "2", "--partition", "iid", "--section", "tm"]
    assert timemodel.main(args) == 0
    assert "![time model](figures/time-model.png)" in (out / "report.md").read_text()
    assert (out / "figures" / "time-model.png").is_file() and not (tmp_path / "docs").exists()


@pytest.mark.parametrize("module", [sweep, report, robustness, timemodel], ids=lambda m: m.__name__.split(".")[-1])
def test_every_command_line_option_has_a_help_text(module: object) -> None:
    parser = module.build_parser()  # type: ignore[attr-defined]
    missing = [a.dest for a in parser._actions if not (a.help or "").strip()]
    assert missing == [] and parser.prog == f"python -m {module.__name__}"  # type: ignore[attr-defined]


def test_a_methods_style_comes_from_its_name_alone() -> None:
    # The same in every study and every run (pinned: a change would recolour every published figure)
    assert method_style("dlion-vote") == {"color": "#7f7f7f", "marker": "<", "linestyle": "-."}
    assert method_style("fedavg") == {"color": "#800000", "marker": "X", "linestyle": "--"}
    assert len(set(PALETTE)) == 15 and len(set(MARKERS)) == 10 and len(set(LINESTYLES)) == 3
    # The main study's 8 methods get 8 colours (what the salt was picked for)
    _, cells = sweep.load_study(Path(__file__).parents[2] / "examples" / "studies" / "study.toml")
    labels = sorted({c.label for c in cells})
    assert len(labels) == 8 and len({method_style(label)["color"] for label in labels}) == 8


def test_the_seed_band_is_the_mean_min_and_max_over_the_seeds_evaluated() -> None:
    # Prepare: 2 clients; seed 1 stopped after round 1
    def cell(accs: list[float]) -> dict:
        evals = [{"round": i, "accuracy": a, "cum_bytes_up": i * 1e6, "cum_bytes_down": i * 3e6}
                 for i, a in enumerate(accs)]  # fmt: skip
        return {"num_clients": 2, "evals": evals}

    # Execute
    band = seed_band([cell([0.1, 0.5, 0.7]), cell([0.1, 0.3])])
    # Assert: round 1: mean 0.4 of 0.5 and 0.3; 4 MB over 2 clients a round; round 2 from seed 0 alone
    assert band == [
        {"round": 0, "mean": 0.1, "low": 0.1, "high": 0.1, "mb_per_client": 0.0, "seeds": 2},
        {"round": 1, "mean": 0.4, "low": 0.3, "high": 0.5, "mb_per_client": 2.0, "seeds": 2},
        {"round": 2, "mean": 0.7, "low": 0.7, "high": 0.7, "mb_per_client": 4.0, "seeds": 1},
    ]


# ---------------------------------------------------------------- logs and the model digest
def test_log_lines_inside_a_cell_carry_its_name() -> None:
    # Prepare: a handler of our own on Flower's logger
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Keep()
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        # Execute
        with cell_logging("fedavg_iid_n2_s0"):
            logger.warning("round %d failed", 3)
        logger.warning("outside")
    finally:
        logger.removeHandler(handler)
    # Assert: prefixed once inside, not after
    assert lines == ["[fedavg_iid_n2_s0] round 3 failed", "outside"]


def test_the_model_digest_changes_with_one_bit() -> None:
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    flipped = values.copy()
    flipped.view(np.uint32)[1, 2] ^= 1  # the lowest bit of one value
    digest = [sweep.model_digest(ArrayRecord({"w": Array(v)})) for v in (values, values.copy(), flipped)]
    assert digest[0] == digest[1] != digest[2]


def test_a_copied_study_folder_is_still_done(swept: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Cells travel with their folder (out is relative to the study file): nothing runs again
    shutil.copytree(swept.parent, tmp_path / "copy")
    assert sweep.run_sweep(tmp_path / "copy" / "study.toml") == []
    assert "2 cells, 2 done, 0 to run" in capsys.readouterr().out
