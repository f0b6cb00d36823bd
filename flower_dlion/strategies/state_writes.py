"""The state writes that nodes report as failed: logged by node, counted per round, and the stop when no node can.

A client that could not write its state (a full or read-only state folder) says so in its next
reply (:class:`~flower_dlion.protocol.WriteFailure`: a :data:`~flower_dlion.protocol.NOTICE`
record, or the text of its error reply). The check of the replies (:class:`~.reply_check.ReplyCheck`)
reads it with :func:`note` (a WARNING naming the round, the node, its partition, the path and the
errno), counts the round's reports (``state-write-failures``) and asks :meth:`StateWrites.close`
whether the run can go on.

The rule: a round in which **every node that answered** (one at least; error replies count as
answers, nodes without a reply do not) reported a failed state write, in that round or the one
before, stops the run (:class:`~.run_stops.RunStopped`, naming the nodes, the paths and the
errnos): no node can keep the state that Distributed Lion needs between rounds, so every later
round would resync them. The round before counts too because a node says a failed write in its
first reply once it knows: the reply of the same round where its write was waited for, else its
next one, which is then often an error reply. A round in which some node answered without such a
recent report goes on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from logging import WARNING

from flwr.supercore import log

from ..protocol import RejectedReply, WriteFailure
from .run_stops import RunStopped, nodes_text

__all__ = ["SHOWN", "Reported", "StateWrites", "note"]

SHOWN = 5  # failures a stop names in full (the others by count)
Reported = dict[int, tuple[int, WriteFailure]]  # node id → (its partition, what it reported), one round's


def note(
    reported: Reported,
    server_round: int,
    notice: WriteFailure | RejectedReply | None,
    node_id: int,
    pid: int | None = None,
) -> None:
    """Keep (and log) the failed state write that a reply of ``node_id`` reports, if it reports one.

    ``notice``: what the reply says (:func:`~flower_dlion.protocol.read_notice`): the failure,
    a malformed :data:`~flower_dlion.protocol.NOTICE` record's fault (logged and ignored: the
    reply itself is judged on its own), or None. ``pid``: the node's partition as the server
    knows it; None: as the reply says (its node's partition id, else its node id). A node's
    first report of the round is kept.
    """
    if node_id in reported or notice is None:
        return
    if isinstance(notice, RejectedReply):
        log(
            WARNING,
            "round %d: node %d reports a state write it could not do, malformed: %s",
            server_round,
            node_id,
            notice,
        )
        return
    failure = dataclasses.replace(notice, node_id=node_id)
    if pid is None:
        pid = failure.partition if failure.partition >= 0 else node_id
    reported[node_id] = (pid, failure)
    log(
        WARNING,
        "round %d: node %d (partition %d) could not write its state to %s: [Errno %d] %s%s; it resyncs from an "
        "older copy or anew (metric state-write-failures)",
        server_round,
        node_id,
        pid,
        failure.path,
        failure.errno,
        failure.error,
        f" (its round {failure.round} state)" if failure.round >= 0 else "",
    )


class StateWrites:
    """The failed state writes the nodes reported, the latest one of each node, and the rule that stops a run.

    Attributes
    ----------
    latest : dict[int, tuple[int, WriteFailure]]
        Node id → the round of its latest report and what it reported.

    """

    WINDOW = 2  # a report counts in its round and the next one (a node may say it in the reply of the round it failed)

    def __init__(self) -> None:
        self.latest: dict[int, tuple[int, WriteFailure]] = {}

    def close(self, reported: Reported, server_round: int, answered: Collection[int]) -> RunStopped | None:
        """Keep the round's reports; the stop when every node that answered (one at least) reported lately.

        Lately: in this round or the one before (:attr:`WINDOW`). None when some node answered
        without such a report, or none answered.
        """
        for node_id, (_, failure) in reported.items():
            self.latest[node_id] = (server_round, failure)
        recent = {n for n, (r, _) in self.latest.items() if r > server_round - self.WINDOW}
        if not answered or not set(answered) <= recent:
            return None
        failures = [self.latest[n][1] for n in sorted(answered)]
        shown = "; ".join(f.text() for f in failures[:SHOWN])
        more = f"; and {len(failures) - SHOWN} more" if len(failures) > SHOWN else ""
        why = (
            f"no node can keep its state: every node that answered round {server_round} "
            f"({nodes_text(sorted(answered))}) reported in it or the round before that it could not write its "
            f"state: {shown}{more}. Free space in the nodes' state folder or choose a writable one (run config "
            "'client-state-dir', DLionClient(state_dir=...), FLOWER_DLION_STATE_DIR), then go on from the last "
            "checkpoint"
        )
        return RunStopped(why, server_round)
