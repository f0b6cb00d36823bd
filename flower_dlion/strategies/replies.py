"""A round's replies, sorted out: the valid ones, the nodes that answered, the rejected ones (each logged).

:func:`check_replies` is what ``ServerModelStrategy._check_and_log_replies`` runs. A reply that shows
that its node cannot take part (:func:`wrong_layout`: the arrays of another model, or the client's own
error saying so) leaves its node out of sampling until it says hello again
(:meth:`~.nodes.Nodes.leave_out`, one WARNING line), instead of a rejected reply every round.
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

__all__ = ["CLIENT_LAYOUT_ERRORS", "CheckedReplies", "check_replies", "wrong_layout"]

R = TypeVar("R")

CLIENT_LAYOUT_ERRORS = ("server model layout",)
"""In a client's error reason when its model has another layout than the server's (``clients/replica.py``)."""


@dataclass
class CheckedReplies(Generic[R]):
    """The replies of one round, sorted out by :func:`check_replies`."""

    valid: list[R] = field(default_factory=list)  # what the check made of each valid reply, in arrival order
    answered: set[int] = field(default_factory=set)  # nodes that replied, validly or not
    rejected: int = 0  # replies refused (malformed, stale, an error, a node's second reply)


def wrong_layout(msg: Message, err: RejectedReply) -> bool:
    """Whether a rejected reply shows that its node's model has another layout than the federation's.

    The server's own check marks it (``RejectedReply(final=True)``: an array of another shape); a
    client's error reply says so in its reason (:data:`CLIENT_LAYOUT_ERRORS`).
    """
    if err.final:
        return True
    return msg.has_error() and any(what in msg.error.reason for what in CLIENT_LAYOUT_ERRORS)


def check_replies(
    server_round: int,
    replies: Iterable[Message],
    check: Callable[[Message], R],
    on_rejected: Callable[[Message, int, int, RejectedReply, bool], None] | None,
    *,
    nodes: Nodes,
    failures: FailedRounds,
    outbox: list[Message],
) -> CheckedReplies[R]:
    """Validate each reply with ``check``; log and count the ones it refuses, and second replies.

    ``check(msg)`` returns the parsed reply or raises :class:`RejectedReply`. For a refused reply,
    ``on_rejected(msg, node_id, partition, error, again)`` is called before the node is marked as
    answered; ``again`` is true for the node's second reply of the round. Each refusal is logged
    (one WARNING line) and noted in ``failures``; a reply of the wrong layout (:func:`wrong_layout`)
    leaves its node out of sampling (``nodes.leave_out``: its line, once, replaces the rejection's). The
    sampled nodes of ``outbox`` (the round's train messages) without a reply are logged too.
    """
    out: CheckedReplies[R] = CheckedReplies()
    for msg in replies:
        node_id, pid = nodes.reply_node(msg, outbox)  # a SuperLink error reply: the node's
        try:
            if node_id in out.answered:
                raise RejectedReply("a second reply from this node in this round")
            parsed = check(msg)
        except RejectedReply as err:
            out.rejected += 1
            if on_rejected is not None:
                on_rejected(msg, node_id, pid, err, node_id in out.answered)
            out.answered.add(node_id)
            if not (wrong_layout(msg, err) and nodes.leave_out(node_id, pid, str(err), server_round)):
                why = "round %d: rejected reply from node %d (partition %d): %s"
                log(WARNING, why, server_round, node_id, pid, err)
            failures.reject(node_id, whole_reason(msg, err))
            continue
        out.answered.add(node_id)
        out.valid.append(parsed)
    for msg in outbox:
        if (node_id := msg.metadata.dst_node_id) not in out.answered:
            pid = nodes.partition_of(node_id)
            log(WARNING, "round %d: no reply from node %d (partition %d)", server_round, node_id, pid)
    return out
