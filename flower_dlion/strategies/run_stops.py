"""When a run stops because it cannot learn: :class:`RunStopped`, and the count of failed rounds that raises it.

A round *fails* when it has fewer than ``min_replies`` valid replies. :class:`FailedRounds`
counts the failed rounds in a row and keeps why replies were rejected in them (an error reply's
traceback shortened to its root cause, :func:`short_reason`); at ``max_failed_rounds`` it raises
:class:`RunStopped`, whose message names the rounds, the nodes and the reasons. Our strategies
(``ServerModelStrategy``) and the repository app's FedAvg family (``server_app``) use it; a
round 1 in which every node's hello failed stops the same way, and so does a round that has too few
nodes after waiting ``wait_for_nodes`` seconds (:meth:`~.nodes.Nodes.discover`).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Collection

from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID

from ..protocol import error_text
from .replies import CheckedReplies

__all__ = ["FailedRounds", "RunStopped", "nodes_text", "reply_error", "short_reason", "whole_reason"]


class RunStopped(RuntimeError):
    """The run cannot learn: too few nodes, no node answers the hello, or too many rounds without a valid reply.

    Raised by a strategy's ``configure_train`` (no node answered the hello usefully; fewer nodes
    than ``min_available_nodes`` connected, or than secure aggregation needs able to take part, after
    ``wait_for_nodes`` seconds) or ``aggregate_train`` (``max_failed_rounds`` failed rounds in a
    row); the message starts with "the run cannot learn: " and says which rounds, which nodes and why.

    Attributes
    ----------
    server_round : int
        The round in which the run stopped.

    """

    def __init__(self, why: str, server_round: int) -> None:
        super().__init__(f"the run cannot learn: {why}")
        self.server_round = server_round


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EXCEPTION_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): ?\S.*$", re.M)
_OUTER_CLASS = re.compile(r"<class '([^']+)'>")


def reply_error(msg: Message) -> str:
    """An error reply's whole reason, as :func:`~flower_dlion.protocol.error_text` says it, but not cut.

    ``error_text`` keeps 2000 characters, which can lose what matters in a traceback (Ray's reasons
    hold the remote one): the exception itself.
    """
    who = "the SuperLink reports" if msg.metadata.src_node_id == SUPERLINK_NODE_ID else "client error"
    return f"{who} (code {msg.error.code}): {msg.error.reason}"


def short_reason(reason: str, limit: int = 500) -> str:
    """``reason`` in one line of at most ``limit`` characters: a traceback becomes the exception raised.

    A short one-line reason is kept as it is. In a longer one (colour codes removed) the last
    exception line with a message (the exception raised; a wrapper such as Flower's
    ``ClientAppException:`` carries none) follows the text before the first "<class ...>" and
    that class, e.g. "client error (code 2): <class 'ray.exceptions.RayTaskError(ClientAppException)'>
    … ZeroDivisionError: division by zero"; without one, the start and the end of the text.
    """
    if len(reason) <= limit and "\n" not in reason:
        return reason
    text = _ANSI.sub("", reason)
    outer = _OUTER_CLASS.search(text)
    found = next(reversed(list(_EXCEPTION_LINE.finditer(text))), None)  # the last one
    if found is not None:
        head = text[: outer.end()] if outer is not None and outer.start() < found.start() else ""
        short = f"{head} … {found.group(0).strip()}" if head else found.group(0).strip()
    else:
        flat = " ".join(text.split())
        short = flat if len(flat) <= limit else f"{flat[: limit // 2 - 2]} … {flat[-(limit // 2 - 2) :]}"
    short = " ".join(short.split())
    return short if len(short) <= limit else short[: limit - 3] + "..."


def nodes_text(node_ids: list[int]) -> str:
    """``node 5``, ``nodes 5, 7, 9`` or ``nodes 5, 7, 9 (and 4 more)`` (in increasing order)."""
    node_ids = sorted(node_ids)
    if len(node_ids) == 1:
        return f"node {node_ids[0]}"
    shown = ", ".join(str(n) for n in node_ids[:3])
    return f"nodes {shown}" + (f" (and {len(node_ids) - 3} more)" if len(node_ids) > 3 else "")


def whole_reason(msg: Message, err: Exception) -> str:
    """Why a reply was rejected: for an error reply, its whole reason (the logged one is cut)."""
    reason = str(err)
    if msg.has_error() and reason == error_text(msg):
        return reply_error(msg)
    return reason


class FailedRounds:
    """Counts the rounds in a row without enough valid replies, and why replies were rejected in them.

    A round is failed when it has fewer than ``min_replies`` valid replies; a round with enough
    resets the count and forgets the reasons. When the count reaches ``max_failed_rounds`` (0:
    never), :meth:`outcome` raises :class:`RunStopped` with the rounds, the last round's own
    account and the last :data:`KEPT_REASONS` distinct reasons replies were rejected for (each
    with how often and from which nodes).

    Parameters
    ----------
    max_failed_rounds : int
        Failed rounds in a row that stop the run; 0 never stops it.
    min_replies : int (default: 1)
        Valid replies a round needs not to count as failed.

    """

    KEPT_REASONS = 5

    def __init__(self, max_failed_rounds: int, min_replies: int = 1) -> None:
        self.max_failed_rounds = max_failed_rounds
        self.min_replies = min_replies
        self.count = 0  # failed rounds in a row so far
        self.first = 0  # the first of them
        self._reasons: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()  # reason → (times, node ids)

    def reject(self, node_id: int, reason: str) -> None:
        """Note a rejected reply (or hello) of the round in progress and why (a traceback: its root cause)."""
        reason = short_reason(reason)
        times, nodes = self._reasons.pop(reason, (0, []))
        if node_id not in nodes:
            nodes.append(node_id)
        self._reasons[reason] = (times + 1, nodes)
        while len(self._reasons) > self.KEPT_REASONS:
            self._reasons.popitem(last=False)

    def count_round(self, server_round: int, checked: CheckedReplies, valid: int, sent: Collection[int]) -> None:
        """Note each refused reply of the round and why (:meth:`reject`), then count it (:meth:`outcome`).

        ``valid``: the replies that counted; ``sent``: the nodes sent a train message. The round's own
        account names both counts, the rejected replies and the nodes without one.

        Raises
        ------
        RunStopped
            When this is the ``max_failed_rounds``-th failed round in a row.

        """
        for reply, err in checked.refused:
            self.reject(reply.node_id, whole_reason(reply.msg, err))
        missing = len(set(sent) - checked.answered)
        why = f"{valid} valid of {len(sent)} sent ({checked.rejected} rejected, {missing} without a reply)"
        self.outcome(server_round, valid, why)

    def outcome(self, server_round: int, valid: int, why: str) -> None:
        """Count ``server_round`` as failed (fewer than ``min_replies`` valid replies) or reset the count.

        Raises
        ------
        RunStopped
            When this is the ``max_failed_rounds``-th failed round in a row.

        """
        if valid >= self.min_replies:
            self.count = 0
            self._reasons.clear()
            return
        if self.count == 0:
            self.first = server_round
        self.count += 1
        if self.max_failed_rounds and self.count >= self.max_failed_rounds:
            raise RunStopped(self._summary(server_round, why), server_round)

    def _summary(self, server_round: int, why: str) -> str:
        """What :class:`RunStopped` says: the rounds, the last one's account, the reasons, what to look at."""
        least = "without a valid reply" if self.min_replies == 1 else f"with fewer than min_replies={self.min_replies}"
        rounds = f"round {server_round}" if self.count == 1 else f"rounds {self.first} to {server_round}"
        text = (
            f"{self.count} round{'s' if self.count > 1 else ''} in a row {least} ({rounds}; "
            f"max_failed_rounds={self.max_failed_rounds}); round {server_round}: {why}. "
        )
        if self._reasons:
            text += "Rejected in these rounds: " + "; ".join(
                f"{times}× from {nodes_text(nodes)}: {reason}" for reason, (times, nodes) in self._reasons.items()
            )
        else:
            text += "No reply was rejected: the nodes sent none (none sampled, or none answered within the timeout)"
        return text + (
            ". Look at these errors in the clients' logs (the ClientApp, its data, the learning rate and weight "
            "decay); max_failed_rounds = 0 (run config 'max-failed-rounds') never stops a run"
        )
