"""A round's replies, sorted out in three steps that each return data.

1. :func:`sort_replies`: whose each reply is (its node and partition; a SuperLink error reply is
   the node's it answers for) and whether it is the node's second reply of the round;
2. the strategy's check of each (:class:`~.reply_check.ReplyCheck` for Distributed Lion,
   :func:`check_each` with a check function for others): a :class:`CheckedReplies` of what it made
   of the valid ones and the refused ones with why;
3. :meth:`~.nodes.Nodes.log_refused`: one WARNING line per refused reply and per sampled node
   without one. A reply that shows that its node cannot take part (:func:`~.nodes.wrong_layout`: the arrays
   of another model, or the client's own error saying so) leaves its node out of sampling until it
   says hello again (:meth:`~.nodes.Nodes.leave_out`, one WARNING line) instead of a rejected reply
   every round; a node the SuperLink answered for is forgotten. Each refusal is then noted for the
   run's stop rule (:meth:`~.run_stops.FailedRounds.count_round`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from flwr.app import Message, MetricRecord
from flwr.common.constant import SUPERLINK_NODE_ID

from ..protocol import METRICS, RejectedReply

__all__ = [
    "SECOND_REPLY",
    "CheckedReplies",
    "Reply",
    "check_each",
    "reply_node",
    "reported_losses",
    "sort_replies",
]

R = TypeVar("R")

SECOND_REPLY = "a second reply from this node in this round"


@dataclass(frozen=True)
class Reply:
    """One reply of the round, before it is checked."""

    msg: Message
    node_id: int  # the node it speaks for (a SuperLink error reply: the node of the message it answers)
    partition: int  # that node's key (-1: unknown)
    again: bool  # the node's second reply of the round (refused)
    lost: bool = False  # the SuperLink's error for a node that stopped heartbeating: its id is forgotten


@dataclass
class CheckedReplies(Generic[R]):
    """The replies of one round, checked: what the check made of the valid ones, and the refused ones with why."""

    valid: list[R] = field(default_factory=list)  # in arrival order
    refused: list[tuple[Reply, RejectedReply]] = field(default_factory=list)
    answered: set[int] = field(default_factory=set)  # nodes that replied, validly or not

    @property
    def rejected(self) -> int:
        """Replies refused (malformed, stale, an error, a node's second reply)."""
        return len(self.refused)


def sort_replies(replies: Iterable[Message], outbox: list[Message], partitions: Mapping[int, int]) -> list[Reply]:
    """Each reply with its node, partition and whether the node replied before in this round.

    ``outbox``: the round's train messages; ``partitions``: node id → partition (``Nodes.pid_of``),
    -1 for a node it does not hold.
    """
    first: dict[int, int] = {}  # node id → the index of its first reply
    out = []
    for i, msg in enumerate(replies):
        node_id, lost = reply_node(msg, outbox)
        again = first.setdefault(node_id, i) != i
        out.append(Reply(msg, node_id, partitions.get(node_id, -1), again, lost))
    return out


def reply_node(reply: Message, sent: Iterable[Message]) -> tuple[int, bool]:
    """The node a reply speaks for, and whether the SuperLink answered for it (its id is then forgotten).

    A node's own reply: its sender. When a node stops heartbeating, the SuperLink answers the
    message sent to it with an error of its own (sender ``SUPERLINK_NODE_ID``); that reply is the
    node's, found by the message it answers (``reply_to_message_id``; the Grid gave the sent
    messages their ids). :meth:`~.nodes.Nodes.log_refused` then forgets the node's id, so that it
    is greeted again (hello) when it reconnects: a SuperNode restarted under node authentication
    keeps its id, but not its state.
    """
    node_id = reply.metadata.src_node_id
    answered = reply.metadata.reply_to_message_id
    if node_id == SUPERLINK_NODE_ID and answered:
        for msg in sent:
            if msg.metadata.message_id == answered:
                return msg.metadata.dst_node_id, True
    return node_id, False


def reported_losses(arrived: list[Reply], sent: Collection[int]) -> dict[tuple[int, int], float]:
    """Each sent node's own ``train-loss`` as its first reply states it, valid or rejected (a NaN is rejected).

    Keyed by (node id, partition), as :mod:`.divergence` names nodes; error replies, and replies
    without a number there, are left out.
    """
    out: dict[tuple[int, int], float] = {}
    first: dict[int, int] = {}  # sender → the index of its first reply that counts
    for i, reply in enumerate(arrived):
        msg = reply.msg
        node_id = msg.metadata.src_node_id
        if msg.has_error() or node_id not in sent or first.setdefault(node_id, i) != i:
            continue
        try:
            record = msg.content[METRICS]
            value = record["train-loss"] if isinstance(record, MetricRecord) else None
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[(node_id, reply.partition)] = float(value)
    return out


def check_each(replies: list[Reply], check: Callable[[Message], R]) -> CheckedReplies[R]:
    """``check(msg)`` of each reply (a node's second reply refused without it); RejectedReply: refused."""
    out: CheckedReplies[R] = CheckedReplies()
    for reply in replies:
        out.answered.add(reply.node_id)
        try:
            if reply.again:
                raise RejectedReply(SECOND_REPLY)
            out.valid.append(check(reply.msg))
        except RejectedReply as err:
            out.refused.append((reply, err))
    return out
