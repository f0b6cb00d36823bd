"""Byte accounting for any strategy: a ``Grid`` wrapper that measures every message it carries.

``MeteredGrid(grid)`` passes everything through to ``grid`` and, for each
``send_and_receive`` call (one per round and message type in ``Strategy.start``), records
the measured size of every message sent and every reply received (``protocol.message_bytes``:
the deflated Flower objects as they go on the wire). D-Lion, the gradient baselines and
Flower's own FedAvg are therefore counted by the same code.

With ``poll_interval``, ``send_and_receive`` pushes the messages and pulls for replies every
``poll_interval`` seconds itself (Flower's deployment Grid sleeps 3 s between pulls); same
semantics otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from flwr.app import Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from flower_dlion.protocol import message_bytes

__all__ = ["Exchange", "MeteredGrid"]


@dataclass
class Exchange:
    """One ``send_and_receive`` call: what went out and what came back."""

    message_type: str
    num_sent: int
    num_replies: int
    num_errors: int
    bytes_down: int  # server → clients
    bytes_up: int  # clients → server
    train_loss: float | None  # example-weighted mean of the replies' "train-loss"


def _reported_loss(replies: list[Message]) -> float | None:
    """Example-weighted mean of ``train-loss`` over replies whose metrics carry it."""
    total = weight = 0.0
    for msg in replies:
        if msg.has_error():
            continue
        for record in msg.content.values():
            if isinstance(record, MetricRecord) and "train-loss" in record and "num-examples" in record:
                total += float(record["train-loss"]) * float(record["num-examples"])
                weight += float(record["num-examples"])
    return total / weight if weight > 0 else None


class MeteredGrid(Grid):
    """Wrap a ``Grid`` and measure the bytes of every message through ``send_and_receive``.

    Parameters
    ----------
    grid : Grid
        The grid to wrap (simulation, deployment or ``LocalGrid``).
    poll_interval : float | None (default: None)
        Seconds between pulls for replies; None: the wrapped grid's own ``send_and_receive``.

    Attributes
    ----------
    exchanges : list[Exchange]
        One entry per non-empty ``send_and_receive`` call, in order.

    """

    def __init__(self, grid: Grid, *, poll_interval: float | None = None) -> None:
        if poll_interval is not None and not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval}")
        self.grid = grid
        self.poll_interval = poll_interval
        self.exchanges: list[Exchange] = []

    def set_run(self, run: Run) -> None:
        """Pass through."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """Pass through."""
        return self.grid.run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        """Pass through."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """Pass through."""
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Pass through (not metered: strategies use ``send_and_receive``)."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Pass through (not metered: strategies use ``send_and_receive``)."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Send, receive, and record the measured bytes both ways."""
        messages = list(messages)
        if not messages:
            return self.grid.send_and_receive(messages, timeout=timeout)
        down = sum(message_bytes(m) for m in messages)
        replies = self._exchange(messages, timeout)
        self.exchanges.append(
            Exchange(
                message_type=messages[0].metadata.message_type,
                num_sent=len(messages),
                num_replies=len(replies),
                num_errors=sum(1 for r in replies if r.has_error()),
                bytes_down=down,
                bytes_up=sum(message_bytes(r) for r in replies),
                train_loss=_reported_loss(replies),
            )
        )
        return replies

    def _exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Push, then pull until every message is answered or ``timeout`` s have passed (None: no limit)."""
        if self.poll_interval is None:
            return list(self.grid.send_and_receive(messages, timeout=timeout))
        waiting = {i for i in self.grid.push_messages(messages) if i}  # a failed push is None: no reply will come
        end = time.monotonic() + (timeout or 0.0)
        replies: list[Message] = []
        while waiting:
            got = list(self.grid.pull_messages(waiting))
            replies.extend(got)
            waiting.difference_update(r.metadata.reply_to_message_id for r in got)
            if not waiting or (timeout is not None and time.monotonic() >= end):
                break
            time.sleep(self.poll_interval)
        return replies
