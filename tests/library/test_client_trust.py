"""Issue 49: what a client trusts, about its own state and about the server's messages.

* a node's state belongs to one run and one node: two runs with the same run id (in-process
  grids, parallel sweeps) never share it, and a client never reads, replaces or deletes a file
  it did not write; what a write cut short left behind is cleaned up;
* a state folder the node cannot write fails its hello, before round 1;
* every number a train message sets is range-checked before it touches the state, with the
  key, the value and the limit in the error; the local work of a round is bounded; a malformed
  message is refused by name, not with a bare KeyError;
* a deleted, truncated or poisoned (NaN) state file: the node says which file and why, and
  resyncs.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict

from flower_dlion import DistributedLion
from flower_dlion.clients.state import ClientStateError, HostState, crc32
from flower_dlion.clients.state_store import StateStore, read_state_file, read_state_header, write_state_file
from flower_dlion.protocol import CONFIG, HELLO, HELLO_ACTION, SERVER_UPDATE
from flower_dlion.round_records import RoundConfig
from flower_dlion.testing import LocalGrid

from ..byom import ByomNet
from ..states import load
from .test_client_state import _files_run, _go_on, byom_app, on_device, run


def _round(strategy: DistributedLion, grid: LocalGrid, server_round: int, arrays: ArrayRecord) -> None:
    msgs = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
    strategy.aggregate_train(server_round, grid.send_and_receive(msgs))


def _dead_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# ---------------------------------------------------------------- state of one run and one node
@pytest.mark.parametrize("in_context", [True, False])
def test_two_federations_interleaved_in_one_process_end_as_each_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, in_context: bool
) -> None:
    # Prepare: two federations with the same run id (LocalGrid: 1), node ids and partitions, different rates;
    # one ClientApp (one DLionClient) serves both; without state_in_context their files go to the default folder
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rounds, rates = 4, (1e-3, 3e-3)

    def federation(lr: float) -> tuple[DistributedLion, LocalGrid]:
        return DistributedLion(lr=lr, sample_seed=1, fraction_train=0.67), LocalGrid(app, 3)

    app, client = byom_app(state_in_context=in_context)
    torch.manual_seed(0)
    initial = ArrayRecord(ByomNet().state_dict())
    alone = []
    for lr in rates:  # Execute: each alone, then both interleaved round by round
        s, grid = federation(lr)
        for r in range(1, rounds + 1):
            _round(s, grid, r, initial)
        alone.append(s)
    together = [federation(lr) for lr in rates]
    for r in range(1, rounds + 1):
        for s, grid in together:
            _round(s, grid, r, initial)
    client.wait()
    # Assert: bit for bit the same models and rounds; nothing rejected or resynced; one folder per run
    for a, (t, _) in zip(alone, together, strict=True):
        assert torch.equal(a.x, t.x)
        assert [h["num-replies"] for h in a.history] == [h["num-replies"] for h in t.history] == [2] * rounds
        assert all(h["num-rejected"] == h["state-resets"] == 0 for h in t.history)
    assert not torch.equal(alone[0].x, alone[1].x)
    keys = {s.run_key for s in alone} | {s.run_key for s, _ in together}
    assert len(keys) == 4
    folders = {p.name for p in (tmp_path / f"flower-dlion-state-{__import__('os').getuid()}").glob("*")}
    assert folders == (set() if in_context else keys)


def test_a_client_never_reads_replaces_or_deletes_a_file_it_did_not_write(tmp_path: Path) -> None:
    # Prepare: 2 rounds with state files; then another run's state and a user's file appear in partition 0's folder
    strategy, grid, client = _files_run(tmp_path, 2)
    folder = tmp_path / strategy.run_key / "partition-0"
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    foreign = HostState(1, 9, crc32(x), np.zeros(8, np.float32), owner="other-run/partition-0", x=x)
    write_state_file(folder / "r9.state", foreign)
    write_state_file(folder / "slot-7.state", foreign)
    (folder / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.name in ("r9.state", "slot-7.state", "notes.txt")}
    on_device(client).residents.drop(f"{strategy.run_key}/partition-0")  # a new process: it reads the folder
    # Execute
    _go_on(strategy, grid, range(3, 6))
    client.wait()
    # Assert: the foreign files untouched (not refused, renamed or deleted); the node trained every round
    after = {p.name: p.read_bytes() for p in folder.iterdir() if p.name in before}
    assert after == before
    assert not list(folder.glob("*.refused"))
    assert all(h["num-replies"] == 2 and h["full-syncs"] == 0 for h in strategy.history[2:])
    assert {read_state_header(p)["round"] for p in folder.glob("slot-*.state") if p.name != "slot-7.state"} == {4, 5}


def test_what_a_write_cut_short_left_behind_is_cleaned_up(tmp_path: Path) -> None:
    # Prepare: a node's folder with a temporary state file, an anchor's and a marker of a process that died
    # mid-write, and a marker of a live process (pid 1) that is not this node's to remove
    dead = _dead_pid()
    folder = tmp_path / "run" / "partition-0"
    (tmp_path / "run" / "anchors").mkdir(parents=True)
    folder.mkdir()
    left = [folder / f".slot-0.state.{dead}.tmp", tmp_path / "run" / "anchors" / f".a0-0000abcd.{dead}.tmp.npy"]
    left.append(folder / f".r3.pending.{dead}")
    for p in left:
        p.write_bytes(b"partial")
    alive = folder / ".r4.pending.1"
    alive.touch()
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    store = StateStore(ctx, in_context=False, folder=folder, as_of=-1, keep_round=0, owner="run/partition-0")
    x = np.zeros(4, np.float32)
    # Execute
    store.save(HostState(0, 2, crc32(x), np.zeros(4, np.float32), owner="run/partition-0", x=x))
    # Assert
    assert [p.exists() for p in left] == [False, False, False]
    assert alive.exists() and (folder / "slot-0.state").exists()


def test_a_state_folder_the_node_cannot_write_fails_its_hello(tmp_path: Path) -> None:
    # Prepare: the state folder's parent is a file
    (tmp_path / "file").write_text("")
    _, client = byom_app(state_in_context=False, state_dir=str(tmp_path / "file" / "state"))
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    hello = Message(RecordDict({HELLO: ConfigRecord({"state-key": "k1"})}), dst_node_id=7, message_type="query")
    # Execute / Assert: the hello names the node, the folder and what to set
    with pytest.raises(ClientStateError, match=r"node 7: its state folder .*file/state/k1/partition-0 cannot be "):
        client.hello(hello, ctx)
    assert HELLO_ACTION == "dlion"


# ---------------------------------------------------------------- the server's numbers, range-checked
GOOD = {"server-round": 3, "version": 2, "beta1": 0.9, "beta2": 0.99}


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("beta2", 5.0, "a finite number in [0, 1)"),
        ("beta1", float("nan"), "a finite number in [0, 1)"),
        ("accumulate", -3, "an int in [1, "),
        ("local-steps", 0, "an int in [1, "),
        ("local-lr", -1.0, "a finite number >= 0"),
        ("local-weight-decay", float("inf"), "a finite number >= 0"),
        ("local-proximal-mu", 1e7, "a finite number in [0, 1e+06]"),
        ("upload", "all", "one of ('sign', "),
        ("local-optimizer", "adam", "one of ('lion', 'sgd')"),
        ("scale-block", -1, "an int in [0, 2147483648]"),
        ("momentum-sync", 2, "0 or 1"),
        ("seed", -1, "an int in [0, "),
        ("version", "3", "an int in [0, "),
        ("state-key", "../../etc", "a folder name of 1 to 64 letters, digits, '_' or '-'"),
        ("keep-round", -2, "an int in [0, "),
    ],
)
def test_every_number_a_server_sends_is_range_checked(key: str, value: object, allowed: str) -> None:
    # Execute / Assert
    with pytest.raises(ClientStateError) as err:
        RoundConfig.parse(ConfigRecord(GOOD | {key: value}), 4)
    assert f"node 4: the server sent {key} = {value!r} ({allowed}" in str(err.value)


def test_the_round_config_reads_defaults_for_what_the_server_leaves_out() -> None:
    cfg = RoundConfig.parse(ConfigRecord(GOOD), 4)
    assert cfg == RoundConfig(server_round=3, version=2, beta1=0.9, beta2=0.99)
    assert (cfg.local_steps, cfg.accumulate, cfg.upload, cfg.state_key, cfg.state_round) == (1, 1, "sign", "", None)
    with pytest.raises(ClientStateError, match="node 4: the server's train config has no 'beta2': refused"):
        RoundConfig.parse(ConfigRecord({k: v for k, v in GOOD.items() if k != "beta2"}), 4)


def test_a_round_asking_for_more_local_work_than_the_client_allows_is_refused() -> None:
    record = ConfigRecord(GOOD | {"local-steps": 10**9})
    with pytest.raises(
        ClientStateError, match=r"local-steps × accumulate = 1000000000 × 1 = 1000000000 batches, more "
    ):
        RoundConfig.parse(record, 4)
    assert RoundConfig.parse(ConfigRecord(GOOD | {"local-steps": 40, "accumulate": 25}), 4).local_steps == 40
    with pytest.raises(ClientStateError, match=r"40 × 25 = 1000 batches, more than this client's limit of 999"):
        RoundConfig.parse(ConfigRecord(GOOD | {"local-steps": 40, "accumulate": 25}), 4, max_batches=999)
    with pytest.raises(ValueError, match="max_batches must be an int >= 1, got 0"):
        byom_app(max_batches=0)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda msg: msg.content[CONFIG].__setitem__("beta2", 5.0), "the server sent beta2 = 5.0 ("),
        (lambda msg: msg.content[CONFIG].__setitem__("accumulate", -3), "the server sent accumulate = -3 ("),
        (
            lambda msg: msg.content[CONFIG].__setitem__("local-steps", 10**9),
            "the server's round 3 config asks for local-steps × accumulate = 1000000000 × 1",
        ),
        (lambda msg: msg.content[SERVER_UPDATE].__delitem__("counts"), "an anchored message without its counts"),
        (
            lambda msg: msg.content[CONFIG].__delitem__("kind"),
            "the server's round 3 message is malformed (KeyError: 'kind')",
        ),
    ],
)
def test_a_hostile_round_config_is_refused_by_name_and_the_node_keeps_its_state(
    caplog: pytest.LogCaptureFixture, change, reason: str
) -> None:
    # Prepare: 2 rounds in context state; round 3's message to node 1000 is changed
    app, _ = byom_app(state_in_context=True)
    strategy, grid = run(app, 2, nodes=2)
    before = load(grid.context(1000))
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    msgs = list(strategy.configure_train(3, ArrayRecord(), ConfigRecord(), grid))
    for msg in msgs:
        if msg.metadata.dst_node_id == 1000:
            change(msg)
    strategy.aggregate_train(3, grid.send_and_receive(msgs))
    kept = load(grid.context(1000))
    _go_on(strategy, grid, range(4, 6))
    # Assert: the reply rejected naming node and reason; its state as it was; then back in every round
    said = [r.getMessage() for r in caplog.records if "rejected reply from node 1000" in r.getMessage()]
    assert said and f"node 1000: {reason}" in said[0]
    assert (kept.round, kept.version, kept.host.stamp) == (before.round, before.version, before.host.stamp)
    assert torch.equal(kept.m, before.m) and torch.equal(kept.x, before.x)
    assert [h["num-replies"] for h in strategy.history[2:]] == [1, 2, 2]


def test_a_full_model_without_its_payload_is_refused_by_name() -> None:
    # Prepare: round 1 (every node gets the full model), its payload taken out for node 1000
    app, _ = byom_app(state_in_context=True)
    grid = LocalGrid(app, 2)
    strategy = DistributedLion(lr=1e-3)
    msgs = list(strategy.configure_train(1, ArrayRecord(ByomNet().state_dict()), ConfigRecord(), grid))
    target = next(m for m in msgs if m.metadata.dst_node_id == 1000)
    del target.content[SERVER_UPDATE]["payload"]
    # Execute
    replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(msgs)}
    # Assert
    assert replies[1000].has_error() and not replies[1001].has_error()
    assert "node 1000: the server's round 1 message is malformed (KeyError: 'payload')" in replies[1000].error.reason


# ---------------------------------------------------------------- a deleted, truncated, poisoned state file
def _poison_m(path: Path) -> None:
    meta, arrays = read_state_file(path)
    host = HostState.from_parts(meta, dict(arrays), {}, None, b"")
    host.m = host.m.copy()
    host.m[5] = np.nan
    write_state_file(path, host)


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda p: p.unlink(), None),
        (lambda p: p.write_bytes(p.read_bytes()[:100]), "CRC-32 mismatch"),
        (_poison_m, "the momentum m has non-finite values"),
    ],
)
def test_a_deleted_truncated_or_poisoned_state_file_resyncs_the_node(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, said: str | None
) -> None:
    # Prepare: 2 rounds with files; both of partition 0's slots damaged; its process restarts
    strategy, grid, client = _files_run(tmp_path, 2)
    folder = tmp_path / strategy.run_key / "partition-0"
    for path in sorted(folder.glob("slot-*.state")):
        damage(path)
    on_device(client).residents.drop(f"{strategy.run_key}/partition-0")
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    caplog.set_level(logging.WARNING, logger="flwr")
    # Execute
    _go_on(strategy, grid, range(3, 6))
    client.wait()
    # Assert: named where it was refused; the node out one round at most, then resynced and in every round
    messages = [r.getMessage() for r in caplog.records]
    if said is not None:
        assert any(f"node 1000: its state in {folder}/slot-" in m and said in m for m in messages)
    else:
        assert any(
            f"node 1000 has no replica (new node, or its state was lost) but received kind='counts'; the "
            f"server must send the full model (its state: {folder} (no state there; its round 2 state went to "
            f"{folder} on {socket.gethostname()}, this machine: deleted since?; it resyncs))" in m
            for m in messages
        )
    assert [h["num-replies"] for h in strategy.history[2:]] == [1, 2, 2]
    assert strategy.history[3]["full-syncs"] == 1


def test_a_restarted_node_with_a_truncated_state_file_says_hello_as_a_new_node(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: 2 rounds with files; partition 0's newest file truncated, its process restarted
    strategy, grid, client = _files_run(tmp_path, 2)
    folder = tmp_path / strategy.run_key / "partition-0"
    newest = max(folder.glob("slot-*.state"), key=lambda p: read_state_header(p)["round"])
    newest.write_bytes(newest.read_bytes()[:-1000])
    on_device(client).residents.drop(f"{strategy.run_key}/partition-0")
    ctx = grid.context(1000)
    hello = Message(RecordDict({HELLO: strategy._hello_config(3)}), dst_node_id=1000, message_type="query")
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    # Execute
    answer = client.hello(hello, ctx).content[HELLO]
    # Assert: the file named and put aside, the other slot (round 1) is where the node starts from
    assert f"node 1000: its state in {newest} is refused: CRC-32 mismatch" in caplog.text
    assert newest.with_name(newest.name + ".refused").exists()
    assert answer["version"] == 0 and answer["partition-id"] == 0  # round 1 left it at version 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_node_asked_for_cuda_without_one_fails_its_hello() -> None:
    _, client = byom_app(device="cuda")
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    hello = Message(RecordDict({HELLO: ConfigRecord({"state-key": "k1"})}), dst_node_id=7, message_type="query")
    with pytest.raises(ClientStateError, match=r"device 'cuda' requested but torch.cuda.is_available\(\) is False"):
        client.hello(hello, ctx)
