"""Test helpers: client replies made by hand."""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, Message, RecordDict

from flower_dlion.protocol import CLIENT_UPLOAD, METRICS

__all__ = ["with_arrays"]


def with_arrays(instruction: Message, reply: Message, **arrays: Array) -> Message:
    """A reply to ``instruction`` with the content of ``reply`` plus more Arrays in its delta record."""
    record = ArrayRecord({**dict(reply.content[CLIENT_UPLOAD].items()), **arrays})
    return Message(RecordDict({CLIENT_UPLOAD: record, METRICS: reply.content[METRICS]}), reply_to=instruction)
