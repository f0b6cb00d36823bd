"""Issue 62: a state folder that fills up (or turns read-only) mid-run, and a run that loses most replies.

* a client that could not write its state says so, with its node, the path and the errno, in the
  first reply it sends once it knows (a ``dlion.notice`` record, or its error reply's reason);
* the server logs it by node and partition, counts it per round (``state-write-failures``), and
  stops the run, naming the nodes, paths and errnos, when every node that answered a round
  reported such a failure in it or the round before;
* a run whose rounds lost replies says how many rounds were short and why, in its closing line
  and its Result (``short_rounds``, ``short_reasons``).

A full disk is simulated: the state store's file writer raises ``ENOSPC`` (we run as root, whom
a read-only folder does not stop).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

from flower_dlion import DistributedLion, DLionClient, RunStopped
from flower_dlion.clients import state_store
from flower_dlion.protocol import NOTICE, RejectedReply, WriteFailure, check_envelope
from flower_dlion.strategies.run_loop import short_rounds, short_text, totals_line
from flower_dlion.testing import LocalGrid

from .. import byom
from ..byom import ByomNet
from .test_client_state import byom_app

NO_SPACE = "[Errno 28] No space left on device"
Seen = list[tuple[int, int, dict | None, str | None]]  # (round, node, its notice record, its error reason)


def _full_disk(monkeypatch: pytest.MonkeyPatch, partitions: set[int]) -> dict[str, bool]:
    """The state files of ``partitions`` cannot be written once ``full["on"]`` is set: ENOSPC."""
    write, full = state_store.write_state_file, {"on": False}

    def no_space(path: Path, host, **kw) -> None:
        if full["on"] and int(path.parent.name.removeprefix("partition-")) in partitions:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, host, **kw)

    monkeypatch.setattr(state_store, "write_state_file", no_space)
    return full


def _watched(app: ClientApp, nodes: int, seen: Seen) -> LocalGrid:
    """A grid of ``nodes`` that notes each train reply: its round, node, notice record and error reason."""

    def hook(node_id: int, reply: Message) -> Message:
        if reply.metadata.message_type != "train":
            return reply
        notice = dict(reply.content[NOTICE]) if not reply.has_error() and NOTICE in reply.content else None
        reason = reply.error.reason if reply.has_error() else None
        seen.append((int(reply.metadata.group_id), node_id, notice, reason))
        return reply

    return LocalGrid(app, nodes, reply_hook=hook)


def _start(grid: LocalGrid, rounds: int, on_round_end: Callable[[int], object] | None = None) -> DistributedLion:
    strategy = DistributedLion(lr=1e-3, max_failed_rounds=0)
    torch.manual_seed(0)
    strategy.start(grid, ArrayRecord(ByomNet().state_dict()), num_rounds=rounds, on_round_end=on_round_end)
    return strategy


def _slot(tmp_path: Path, strategy: DistributedLion, partition: int, slot: int) -> str:
    return str(tmp_path / strategy.run_key / f"partition-{partition}" / f"slot-{slot}.state")


# ---------------------------------------------------------------- one node's disk fills
def test_a_node_whose_disk_fills_says_so_in_its_next_reply_and_the_server_counts_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: 3 nodes with state files; partition 1's folder is full from round 3 on (its writes go after
    # the reply: round 3's failure is known at round 4)
    full = _full_disk(monkeypatch, {1})
    app, client = byom_app(state_in_context=False, state_dir=str(tmp_path))
    seen: Seen = []
    grid = _watched(app, 3, seen)
    caplog.set_level(logging.WARNING)
    # Execute
    strategy = _start(grid, 6, lambda r: full.update(on=r >= 2))
    client.wait()
    # Assert: the node says it in round 4 (an error reply: it found its round 2 state only) and in round 6
    # (its round 5 write), nowhere else; the other nodes never
    told = [(r, n, notice, reason) for r, n, notice, reason in seen if notice or (reason and "could not" in reason)]
    path = _slot(tmp_path, strategy, 1, 0)
    text = f"node 1001: could not write its state to {path}: {NO_SPACE}"
    assert [(r, n) for r, n, _, _ in told] == [(4, 1001), (6, 1001)]
    assert told[0][3] == (
        "<class 'flower_dlion.protocol.ClientStateError'>:<'node 1001: replica at version 1, the counts are from "
        f"version 2; {text}'>"
    )
    assert told[1][2] is None and told[1][3] is not None and told[1][3].endswith(f"; {text}'>")
    # the client's log, the server's by node and partition, the metric per round; the run goes on
    assert (
        f"flower-dlion: {text} (its round 3 state; the node's older copy stays; its next reply tells the server)"
        in (caplog.messages)
    )
    assert (
        f"round 4: node 1001 (partition 1) could not write its state to {path}: {NO_SPACE}; it resyncs from an older "
        "copy or anew (metric state-write-failures)"
    ) in caplog.messages
    assert [h["state-write-failures"] for h in strategy.history] == [0, 0, 0, 1, 0, 1]
    assert [h["num-replies"] for h in strategy.history] == [3, 3, 3, 2, 3, 2]


def test_a_write_that_fails_before_the_reply_is_said_in_that_reply(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: partition 0's folder is full from the start; the process's first message (node 1000's, round
    # 1) writes its file before replying, so its failure is known in time for that reply
    full = _full_disk(monkeypatch, {0})
    full["on"] = True
    app, client = byom_app(state_in_context=False, state_dir=str(tmp_path))
    seen: Seen = []
    caplog.set_level(logging.WARNING)
    # Execute
    strategy = _start(_watched(app, 3, seen), 1)
    client.wait()
    # Assert: round 1's valid reply of node 1000 carries the notice; counted, logged with its round
    path = _slot(tmp_path, strategy, 0, 0)
    notices = [(r, n, notice) for r, n, notice, _ in seen if notice is not None]
    assert notices == [
        (
            1,
            1000,
            {
                "state-write-failed": f"node 1000: could not write its state to {path}: {NO_SPACE}",
                "partition-id": 0,
                "path": path,
                "errno": 28,
                "error": "No space left on device",
                "round": 1,
            },
        )
    ]
    assert strategy.history[0]["state-write-failures"] == 1 and strategy.history[0]["num-replies"] == 3
    assert (
        f"round 1: node 1000 (partition 0) could not write its state to {path}: {NO_SPACE} (its round 1 state); "
        "it resyncs from an older copy or anew (metric state-write-failures)"
    ) in caplog.messages


# ---------------------------------------------------------------- no node can keep its state
def test_a_run_stops_when_every_node_that_answers_cannot_write_its_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: every node's folder is full from round 1: node 1000 says so in round 1 (its write came before its
    # reply), nodes 1001 and 1002 in round 2, where none of them has a state ("has no replica")
    full = _full_disk(monkeypatch, {0, 1, 2})
    full["on"] = True
    app, client = byom_app(state_in_context=False, state_dir=str(tmp_path))
    seen: Seen = []
    grid = _watched(app, 3, seen)
    strategy = DistributedLion(lr=1e-3, max_failed_rounds=0)
    torch.manual_seed(0)
    # Execute
    with pytest.raises(RunStopped) as stopped:
        strategy.start(grid, ArrayRecord(ByomNet().state_dict()), num_rounds=5)
    client.wait()
    # Assert: stopped in round 2, its row kept; the reason names the nodes, the paths and the errno
    assert stopped.value.server_round == 2 and len(strategy.history) == 2
    assert [h["state-write-failures"] for h in strategy.history] == [1, 2]
    texts = [
        f"node {1000 + p}: could not write its state to {_slot(tmp_path, strategy, p, 0)}: {NO_SPACE}"
        for p in (0, 1, 2)
    ]
    assert str(stopped.value) == (
        "the run cannot learn: no node can keep its state: every node that answered round 2 (nodes 1000, 1001, "
        f"1002) reported in it or the round before that it could not write its state: {'; '.join(texts)}. Free "
        "space in the nodes' state folder or choose a writable one (run config 'client-state-dir', "
        "DLionClient(state_dir=...), FLOWER_DLION_STATE_DIR), then go on from the last checkpoint"
    )
    # the "has no replica" error reply of a node without state carries the reason
    (reason,) = [reason for r, n, _, reason in seen if (r, n) == (2, 1001)]
    assert reason is not None
    assert "node 1001 has no replica (new node, or its state was lost)" in reason
    assert reason.endswith(f"; {texts[1]}'>")


def test_a_round_with_one_node_that_keeps_its_state_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: partitions 1 and 2 full from round 1, partition 0 fine
    full = _full_disk(monkeypatch, {1, 2})
    full["on"] = True
    app, client = byom_app(state_in_context=False, state_dir=str(tmp_path))
    # Execute
    strategy = _start(LocalGrid(app, 3), 4)
    client.wait()
    # Assert: every round ran; the failures were counted
    assert len(strategy.history) == 4
    assert [h["state-write-failures"] for h in strategy.history] == [0, 2, 0, 2]


# ---------------------------------------------------------------- the wire form
def test_a_notice_round_trips_and_a_bad_one_is_refused_by_name() -> None:
    # Prepare
    failure = WriteFailure(7, 3, "/s/run/partition-3/slot-1.state", 30, "Read-only file system", 5)
    # Execute / Assert: the record and the text (in an error reply's traceback) give it back
    assert WriteFailure.from_record(7, failure.to_record()) == failure
    reason = f"Traceback ...\nflower_dlion.protocol.ClientStateError: node 7 has no replica; {failure.text()}\n"
    assert WriteFailure.find(reason) == WriteFailure(
        7, -1, "/s/run/partition-3/slot-1.state", 30, "Read-only file system"
    )
    assert WriteFailure.find("node 7 has no replica") is None
    with pytest.raises(RejectedReply, match=r"'dlion.notice' holds \{'errno': 'x'\}, expected \['errno', 'error'"):
        WriteFailure.from_record(7, ConfigRecord({"errno": "x"}))


def test_the_reply_check_takes_a_notice_and_nothing_else_unknown() -> None:
    # Prepare
    def reply(*records: str) -> Message:
        sent = Message(RecordDict(), dst_node_id=5, message_type="train", group_id="1")
        return Message(RecordDict({k: ConfigRecord() for k in records}), reply_to=sent)

    # Execute / Assert
    check_envelope(reply("a", "b", NOTICE), {5}, 1, ("a", "b"), optional=(NOTICE,))
    with pytest.raises(RejectedReply, match=r"records \['a', 'b', 'c'\], expected \['a', 'b'\] \(and any of"):
        check_envelope(reply("a", "b", "c"), {5}, 1, ("a", "b"), optional=(NOTICE,))
    with pytest.raises(RejectedReply, match=r"records \['a', 'dlion.notice'\], expected \['a', 'b'\]"):
        check_envelope(reply("a", NOTICE), {5}, 1, ("a", "b"), optional=(NOTICE,))


# ---------------------------------------------------------------- short rounds
def test_a_run_that_lost_most_replies_says_how_many_rounds_were_short_and_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: 3 nodes; from round 2 node 1001's replies are lost and node 1002's handler raises; in round 3
    # node 1000's reply comes with a record the server does not know
    app = ClientApp()
    client = DLionClient(app, ByomNet, state_in_context=True)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 2 and int(msg.metadata.group_id) >= 2:
            raise RuntimeError("no data")
        return client.train(msg, context, DataLoader(byom.partition(0, 4), batch_size=32))

    def hook(node_id: int, reply: Message) -> Message | None:
        if reply.metadata.message_type != "train":
            return reply
        server_round = int(reply.metadata.group_id)
        if node_id == 1001 and server_round >= 2:
            return None
        if node_id == 1000 and server_round == 3:
            reply.content["junk"] = ConfigRecord()
        return reply

    caplog.set_level(logging.INFO, logger="flwr")
    # Execute
    strategy = DistributedLion(lr=1e-3, max_failed_rounds=0)
    torch.manual_seed(0)
    result = strategy.start(LocalGrid(app, 3, reply_hook=hook), ArrayRecord(ByomNet().state_dict()), num_rounds=5)
    # Assert: 4 of 5 rounds short; the reasons summed over them, the most frequent first
    assert [h["num-replies"] for h in strategy.history] == [3, 1, 0, 1, 1]
    assert [h["client-errors"] for h in strategy.history] == [0, 1, 1, 1, 1]
    assert (result.short_rounds, result.short_reasons) == (4, {"no reply": 4, "client error": 4, "rejected": 1})
    last = caplog.records[-1]
    assert last.levelno == logging.WARNING
    assert last.getMessage() == totals_line(result.totals) + (
        "; 4 of 5 rounds short of replies (fewer valid than sent, result.short_rounds): no reply 4, "
        "client error 4, rejected 1"
    )
    assert "Short rounds (result.short_rounds): 4, {'no reply': 4, 'client error': 4, 'rejected': 1}" in str(result)


def test_short_rounds_are_read_from_the_rows() -> None:
    # Prepare: a whole round, a short one of each kind, and a baseline's row without num-failed
    rows = [
        {"num-sampled": 3, "num-replies": 3, "num-rejected": 0, "num-failed": 0, "client-errors": 0},
        {"num-sampled": 3, "num-replies": 1, "num-rejected": 2, "num-failed": 0, "client-errors": 2},
        {"num-sampled": 3, "num-replies": 0, "num-rejected": 1, "num-failed": 2, "client-errors": 0},
        {"num-sampled": 4, "num-replies": 2, "num-rejected": 1},
    ]
    # Execute
    count, reasons = short_rounds(rows)
    # Assert
    assert (count, reasons) == (3, {"no reply": 3, "client error": 2, "rejected": 2})
    assert short_text(count, 4, reasons) == (
        "; 3 of 4 rounds short of replies (fewer valid than sent, result.short_rounds): no reply 3, client error 2, "
        "rejected 2"
    )
    assert short_rounds(rows[:1]) == (0, {}) and short_text(0, 1, {}) == ""
