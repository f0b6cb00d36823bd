"""Issue 60: cross-device federations on one machine and beyond it.

* idle virtual clients cost no memory: the state goes to files by default, and a node's state
  stays on the device only while it trained in one of its run's last rounds;
* a client copied into a process by value (Flower's Ray backend ships an app defined in a
  script with every message) finds what that process holds: no state file read per message;
* a virtual client that lands on a machine without its state files says where they went
  (the machine, the folder) and resyncs; a federation whose contexts cannot fit in memory is
  refused before round 1 with the per-client cost and the number of clients.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from flower_dlion import DistributedLion, DLionClient
from flower_dlion.clients import in_process, state_home
from flower_dlion.clients.resident import RESIDENT_ROUNDS, NodeState, Replica, ReplicaPool, Residents
from flower_dlion.clients.state import ClientStateError
from flower_dlion.clients.state_home import CONTEXT_BYTES, check_fits
from flower_dlion.clients.state_store import MOVED, STATE_WHERE, StateStore
from flower_dlion.testing import LocalGrid

from .. import byom
from ..byom import ByomNet


def initial_arrays() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(ByomNet().state_dict())


def loader(context: Context) -> DataLoader:
    return DataLoader(byom.partition(context.node_config["partition-id"], context.node_config["num-partitions"]), 32)


# ---------------------------------------------------------------- residents
def node(round_: int, pool: ReplicaPool, replica: Replica) -> NodeState:
    state = NodeState(replica, torch.zeros(8))
    state.round = round_
    return state


def test_a_node_stays_resident_only_while_it_trained_in_its_runs_last_rounds() -> None:
    # Prepare: residents with room for every node; nodes of run A in rounds 1, 2, 3, one of run B in round 1
    pool = ReplicaPool()
    replica = Replica(0, torch.zeros(8), 0)
    residents = Residents(pool, None, 1 << 30)
    for r, owner in [(1, "A/n1"), (2, "A/n2"), (3, "A/n3"), (1, "B/n1")]:
        residents.put(owner, node(r, pool, replica))
    # Execute: run A's round 1 + RESIDENT_ROUNDS + 1
    residents.put("A/n4", node(1 + RESIDENT_ROUNDS + 1, pool, replica))
    # Assert: A's node of round 1 went (more than RESIDENT_ROUNDS behind), run B's stays (another run)
    assert RESIDENT_ROUNDS == 3
    assert residents.get("A/n1") is None
    assert [o for o in ("A/n2", "A/n3", "A/n4", "B/n1") if residents.get(o) is not None] == [
        "A/n2",
        "A/n3",
        "A/n4",
        "B/n1",
    ]


def test_a_sampled_federation_keeps_only_its_recent_nodes_resident(tmp_path: Path) -> None:
    # Prepare: 12 nodes, 2 sampled a round, state in files
    app = ClientApp()
    client = DLionClient(app, ByomNet, state_dir=str(tmp_path))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, loader(context))

    grid = LocalGrid(app, 12)
    strategy = DistributedLion(lr=1e-3, fraction_train=2 / 12, min_train_nodes=2, min_available_nodes=2)
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=8)
    # Assert: at most the last RESIDENT_ROUNDS + 1 rounds' nodes resident; every round had its 2 replies
    (here,) = client._devices.values()
    assert all(h["num-replies"] == 2 for h in strategy.history)
    assert 0 < len(here.residents) <= 2 * (RESIDENT_ROUNDS + 1) < 12


# ---------------------------------------------------------------- a client copied by value
def test_a_client_copied_into_a_process_finds_what_the_process_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: every message handled by a fresh copy of the client, as Ray ships an app defined in a script
    app = ClientApp()
    client = DLionClient(app, ByomNet, state_dir=str(tmp_path))
    loads, copies = [], []
    real_load = StateStore.load

    def counting_load(self: StateStore, *args: object, **kwargs: object) -> object:
        loads.append(self.context.node_id)
        return real_load(self, *args, **kwargs)

    monkeypatch.setattr(StateStore, "load", counting_load)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        copy = pickle.loads(pickle.dumps(client))
        copies.append(copy)
        return copy.train(msg, context, loader(context))

    grid = LocalGrid(app, 3)
    strategy = DistributedLion(lr=1e-3)
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=4)
    # Assert: every copy shares the process's models and states; no state file read after the first round
    assert len(copies) == 12 and all(c._devices is client._devices and c is not client for c in copies)
    assert all(h["num-replies"] == 3 and h["num-rejected"] == 0 for h in strategy.history)
    assert len(loads) == 6  # the hello and round 1 only: each node looked twice (nothing there yet)
    assert "_devices" not in pickle.loads(pickle.dumps(client)).__getstate__()  # what travels: settings only


def test_a_copy_in_a_process_that_holds_nothing_starts_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the process registry empty, as in a fresh Ray worker
    client = DLionClient(None, ByomNet)
    payload = pickle.dumps(client)
    monkeypatch.setattr(in_process, "_IN_PROCESS", weakref.WeakValueDictionary())
    # Execute
    copy = pickle.loads(payload)
    again = pickle.loads(payload)
    # Assert: the first copy starts empty and registers; the second shares it
    assert copy._devices == {} and copy._devices is not client._devices
    assert again._devices is copy._devices and copy._served == 0 and again._served == 1


def test_a_copy_finds_the_client_its_process_built_at_import_by_its_model_fn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: the driver's client; a worker process whose app module built its own client at import
    driver = DLionClient(None, ByomNet)
    payload = pickle.dumps(driver)  # the hello handler's bound method carries a copy of the driver's client
    monkeypatch.setattr(in_process, "_IN_PROCESS", weakref.WeakValueDictionary())
    worker = DLionClient(None, ByomNet)
    # Execute
    copy = pickle.loads(payload)
    # Assert: the copy holds what the worker's own client holds (one model, one set of states per process)
    assert copy._devices is worker._devices and copy._choices is worker._choices and copy._served == 1
    # two clients of that model_fn in the process: no guess, the copy starts on its own
    second = DLionClient(None, ByomNet)
    alone = pickle.loads(payload)._devices
    assert alone is not worker._devices and alone is not second._devices


# ---------------------------------------------------------------- a client on another machine
def test_a_client_whose_files_are_on_another_machine_says_where_and_resyncs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: in round 3, partition 1's state files are gone and its context says another machine wrote them
    app = ClientApp()
    client = DLionClient(app, ByomNet, state_dir=str(tmp_path), max_resident=0)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if int(msg.metadata.group_id) == 3 and context.node_config["partition-id"] == 1:
            client.wait()
            where = dict(context.state[STATE_WHERE])
            shutil.rmtree(where["folder"])
            context.state[STATE_WHERE] = ConfigRecord(where | {"host": "ray-worker-7"})
        return client.train(msg, context, loader(context))

    grid = LocalGrid(app, 3)
    strategy = DistributedLion(lr=1e-3)
    caplog.set_level(logging.WARNING)
    # Execute
    strategy.start(grid, initial_arrays(), num_rounds=5)
    # Assert: round 3 refused that reply naming the machine and the cause; round 4 resynced it; all back in round 5
    assert [h["num-rejected"] for h in strategy.history] == [0, 0, 1, 0, 0]
    assert [h["state-resets"] for h in strategy.history] == [0, 0, 1, 0, 0]  # counted as a lost state
    said = [r.getMessage() for r in caplog.records if "ray-worker-7" in r.getMessage()]
    assert said and "not this machine" in said[0] and MOVED in said[0]
    assert strategy.history[3]["full-syncs"] == 1 and strategy.history[4]["num-replies"] == 3


# ---------------------------------------------------------------- what fits
def test_contexts_that_cannot_fit_in_memory_are_refused_with_the_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 10 GB available; 10,000 clients of 281,034 values in context.state (~2.6 MB each)
    monkeypatch.setattr(state_home, "_available_memory", lambda: 10 * 10**9)
    store = StateStore(Context(1, 1, {}, {}, {}), in_context=True, folder=None, as_of=-1, keep_round=0)
    # Execute / Assert
    with pytest.raises(ClientStateError) as err:
        check_fits(store, 281_034, "float32", 7, 10_000)
    text = str(err.value)
    assert "node 7: 10,000 clients" in text and f"{10_000 * CONTEXT_BYTES * 281_034 / 1e9:.1f} GB" in text
    assert "2.59 MB a client" in text and "state-in-context' = false" in text
    check_fits(store, 281_034, "float32", 7, 3_000)  # 7.8 GB: within 80 % of 10 GB


def test_files_that_may_not_fit_on_disk_are_warned_about(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: 1 GB free
    monkeypatch.setattr(state_home, "_free_disk", lambda folder: 10**9)
    monkeypatch.setattr(state_home, "_told", set())
    store = StateStore(Context(1, 1, {}, {}, {}), in_context=False, folder=tmp_path / "n", as_of=-1, keep_round=0)
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    # Execute: files are not refused (a sampled run may touch few clients), the worst case is said once
    check_fits(store, 281_034, "float32", 7, 1_000)
    check_fits(store, 281_034, "float32", 7, 1_000)
    # Assert
    said = [r.getMessage() for r in caplog.records if "each touched at least once" in r.getMessage()]
    assert len(said) == 1 and "1000 clients" in said[0] and "2.92 MB a client" in said[0]


def test_a_simulation_too_large_for_memory_fails_before_round_1(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: state in the contexts, a simulation of 2 million virtual clients (the node config says so)
    app = ClientApp()
    client = DLionClient(app, ByomNet, state_in_context=True)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, loader(context))

    configs = [{"partition-id": i, "num-partitions": 2_000_000} for i in range(2)]
    grid = LocalGrid(app, 2, node_configs=configs)
    strategy = DistributedLion(lr=1e-3)
    # Execute / Assert: every hello refused, the run stops before round 1, the reason names the cost
    with pytest.raises(Exception, match=r"2,000,000 clients keeping their state in context.state need"):
        strategy.start(grid, initial_arrays(), num_rounds=2)
    assert strategy.history == []


# ---------------------------------------------------------------- loading a state the process holds the replica of
def run_loading_from_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, held: bool) -> tuple[object, int]:
    """4 rounds of 3 nodes, every message starting from its state file; the final x and the anchor files read."""
    reads = []
    real = StateStore._read_anchor

    def counting(self: StateStore, version: int, checksum: int) -> object:
        reads.append(version)
        return real(self, version, checksum)

    monkeypatch.setattr(StateStore, "_read_anchor", counting)
    if not held:
        monkeypatch.setattr(ReplicaPool, "idents", lambda self: frozenset())
    app = ClientApp()
    client = DLionClient(app, ByomNet, state_dir=str(tmp_path / str(held)), max_resident=0)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client.train(msg, context, loader(context))

    strategy = DistributedLion(lr=1e-3)
    strategy.start(LocalGrid(app, 3), initial_arrays(), num_rounds=4)
    assert all(h["num-replies"] == 3 and h["num-rejected"] == 0 for h in strategy.history)
    return strategy.x.clone(), len(reads)


def test_a_state_whose_replica_the_process_holds_loads_without_its_anchor_or_x(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Execute: the same run, loads using the held replica, and loads recomputing x from the anchor file
    x_held, reads_held = run_loading_from_files(tmp_path, monkeypatch, held=True)
    monkeypatch.undo()
    x_read, reads_read = run_loading_from_files(tmp_path, monkeypatch, held=False)
    # Assert: bit for bit the same run; no anchor file read while the process holds the replica
    assert torch.equal(x_held, x_read)
    assert reads_held == 0 and reads_read == 9  # rounds 2–4, 3 nodes each


def test_a_reader_waits_for_a_slot_another_process_is_writing_over_in_place(tmp_path: Path) -> None:
    # Prepare: the newest slot's header already says round 5 while a live process (this one) still writes it
    # (a node moving between Flower's simulation workers: its last worker writes after the reply)
    store = StateStore(Context(1, 1, {}, {}, {}), in_context=False, folder=tmp_path, as_of=-1, keep_round=0)
    marker = tmp_path / f".r5.pending.{os.getpid()}"
    marker.touch()
    # Execute / Assert: a write of the newest round in progress is waited for, an older one's is not
    assert store._pending_after(5) and store._pending_after(4)
    assert not store._pending_after(6)
    marker.unlink()
    assert not store._pending_after(5)
