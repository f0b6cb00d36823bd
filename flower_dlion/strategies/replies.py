"""A round's replies, sorted out in three steps that each return data.

1. :func:`sort_replies`: whose each reply is (its node and partition; a SuperLink error reply is
   the node's it answers for) and whether it is the node's second reply of the round;
2. the strategy's check of each (``Uplink.check_replies`` for Distributed Lion, :func:`check_each`
   with a check function for others): a :class:`CheckedReplies` of what it made of the valid
   ones and the refused ones with why;
3. :func:`log_refused`: one WARNING line per refused reply and per sampled node without one, each
   refusal noted for the run's stop rule. A reply that shows that its node cannot take part
   (:func:`wrong_layout`: the arrays of another model, or the client's own error saying so) leaves
   its node out of sampling until it says hello again (:meth:`~.nodes.Nodes.leave_out`, one WARNING
   line) instead of a rejected reply every round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Generic, TypeVar

from flwr.app import Message
from flwr.supercore import log

from ..protocol import RejectedReply
from .nodes import Nodes
from .run_stops import FailedRounds, whole_reason

__all__ = [
    "CLIENT_LAYOUT_ERRORS",
    "SECOND_REPLY",
    "CheckedReplies",
    "Reply",
    "check_each",
    "log_refused",
    "sort_replies",
    "wrong_layout",
]

R = TypeVar("R")

CLIENT_LAYOUT_ERRORS = ("server model layout",)
"""In a client's error reason when its model has another layout than the server's (``clients/replica.py``)."""
SECOND_REPLY = "a second reply from this node in this round"


@dataclass(frozen=True)
class Reply:
    """One reply of the round, before it is checked."""

    msg: Message
    node_id: int  # the node it speaks for (a SuperLink error reply: the node of the message it answers)
    partition: int  # that node's key (-1: unknown)
    again: bool  # the node's second reply of the round (refused)


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


def sort_replies(replies: Iterable[Message], outbox: list[Message], nodes: Nodes) -> list[Reply]:
    """Each reply with its node, partition and whether the node replied before in this round (``outbox``: sent)."""
    seen: set[int] = set()
    out = []
    for msg in replies:
        node_id, pid = nodes.reply_node(msg, outbox)
        out.append(Reply(msg, node_id, pid, node_id in seen))
        seen.add(node_id)
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


def wrong_layout(msg: Message, err: RejectedReply) -> bool:
    """Whether a rejected reply shows that its node's model has another layout than the federation's.

    The server's own check marks it (``RejectedReply(final=True)``: an array of another shape); a
    client's error reply says so in its reason (:data:`CLIENT_LAYOUT_ERRORS`).
    """
    if err.final:
        return True
    return msg.has_error() and any(what in msg.error.reason for what in CLIENT_LAYOUT_ERRORS)


def log_refused(
    server_round: int, checked: CheckedReplies, *, nodes: Nodes, failures: FailedRounds, outbox: list[Message]
) -> None:
    """Log each refused reply (or leave its node out: wrong layout) and note it in ``failures``; log the silent nodes.

    The sampled nodes of ``outbox`` (the round's train messages) without a reply get a line each.
    """
    for reply, err in checked.refused:
        node_id, pid = reply.node_id, reply.partition
        if not (wrong_layout(reply.msg, err) and nodes.leave_out(node_id, pid, str(err), server_round)):
            log(WARNING, "round %d: rejected reply from node %d (partition %d): %s", server_round, node_id, pid, err)
        failures.reject(node_id, whole_reason(reply.msg, err))
    for msg in outbox:
        if (node_id := msg.metadata.dst_node_id) not in checked.answered:
            pid = nodes.partition_of(node_id)
            log(WARNING, "round %d: no reply from node %d (partition %d)", server_round, node_id, pid)
