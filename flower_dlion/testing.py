"""Test your Flower app in process: :class:`LocalGrid`, a ``Grid`` that runs a ``ClientApp``'s nodes here.

A strategy runs on it as on Flower's own grids, e.g. in a pytest test of your app::

    from flower_dlion import DistributedLion
    from flower_dlion.testing import LocalGrid

    grid = LocalGrid(client_app, 3)  # your ClientApp; nodes get partition-id 0, 1, 2
    strategy = DistributedLion(lr=1e-3)
    result = strategy.start(grid, ArrayRecord(Net().state_dict()), num_rounds=3)
    assert [h["num-replies"] for h in strategy.history] == [3, 3, 3]

Every message and every node's ``Context`` goes through Flower's protobuf serialization
on each hop, as on a real SuperLink, so what works here works on the wire; but there
is no Ray, no SuperLink and no subprocess, and a 10-client round takes milliseconds
plus the clients' own compute. Clients run one after the other.

A ClientApp that raises produces an error reply (code 2, as in Flower's simulation) and
its context is left as it was; ``reply_hook`` lets a test corrupt or drop replies.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=no-name-in-module
from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
from flwr.serverapp import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

__all__ = ["LocalGrid"]

ReplyHook = Callable[[int, Message], Message | None]


def _roundtrip(message: Message, message_id: str | None = None) -> Message:
    """Serialize and parse a message (optionally giving it an id, as the SuperLink does)."""
    proto = message_to_proto(message)
    if message_id is not None:
        proto.metadata.message_id = message_id
    return message_from_proto(proto)


class LocalGrid(Grid):
    """Run ``num_nodes`` copies of ``client_app`` in-process behind the Grid interface.

    Parameters
    ----------
    client_app : ClientApp
        The ClientApp every node runs.
    num_nodes : int
        Number of nodes; node ``i`` gets ``partition-id = i`` and
        ``num-partitions = num_nodes`` in its node config.
    run_config : dict | None (default: None)
        The run config every node sees.
    run_id : int (default: 1)
        The run id put on messages and contexts.
    reply_hook : callable | None (default: None)
        ``(node_id, reply) -> reply | None``, applied to each reply before it is
        serialized back; return None to drop the reply (a node that never answers).
    first_node_id : int (default: 1000)
        Node ``i`` gets node id ``first_node_id + i`` (Flower's ids are random per run).
    node_configs : list of dict | None (default: None)
        Each node's node config instead (e.g. ``{}``: SuperNodes without a partition id).

    """

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        run_config: dict[str, Any] | None = None,
        run_id: int = 1,
        reply_hook: ReplyHook | None = None,
        first_node_id: int = 1000,
        node_configs: list[dict[str, Any]] | None = None,
    ) -> None:
        self.client_app = client_app
        self.reply_hook = reply_hook
        self.node_ids = [first_node_id + i for i in range(num_nodes)]
        self._run = Run.create_empty(run_id)
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = 1  # the SuperLink's node id, as seen by a ServerApp
        TaskIdentity.task_id = 0
        self._contexts: dict[int, bytes] = {}
        for i, node_id in enumerate(self.node_ids):
            ctx = Context(
                run_id=run_id,
                node_id=node_id,
                node_config={"partition-id": i, "num-partitions": num_nodes}
                if node_configs is None
                else node_configs[i],
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            self._contexts[node_id] = context_to_proto(ctx).SerializeToString()
        self._pending: dict[str, Message] = {}
        self._killed: set[int] = set()

    # -- Grid interface -------------------------------------------------------
    def set_run(self, run: Run) -> None:
        """Set the run (kept for the interface; the grid made its own)."""
        self._run = run

    @property
    def run(self) -> Run:
        """Run information."""
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """Create a message to a node."""
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """All node ids."""
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Queue messages (serialized, with fresh ids)."""
        ids = []
        for message in messages:
            message_id = uuid.uuid4().hex
            message.metadata.__dict__["_message_id"] = message_id  # as Flower's grids do
            if message.metadata.dst_node_id in self._contexts:  # a message to a node that left gets no reply
                self._pending[message_id] = _roundtrip(message, message_id)
            ids.append(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Run the ClientApp on each queued message and return the replies."""
        replies = []
        for message_id in message_ids:
            message = self._pending.pop(message_id, None)
            if message is None:
                continue
            reply = self._execute(message)
            if reply is not None:
                replies.append(_roundtrip(reply))
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push the messages and return every reply (clients run one after the other)."""
        return self.pull_messages(self.push_messages(messages))

    # -- helpers ---------------------------------------------------------------
    def context(self, node_id: int) -> Context:
        """A copy of a node's current context (parsed from its serialized form)."""
        proto = ProtoContext()
        proto.ParseFromString(self._contexts[node_id])
        return context_from_proto(proto)

    def set_context(self, node_id: int, context: Context) -> None:
        """Replace a node's context (a test's way to tamper with a node's state)."""
        self._contexts[node_id] = context_to_proto(context).SerializeToString()

    def reset_node(self, node_id: int) -> None:
        """Forget a node's state, as when a SuperNode restarts."""
        ctx = self.context(node_id)
        ctx.state = RecordDict()
        self._contexts[node_id] = context_to_proto(ctx).SerializeToString()

    def restart_node(self, node_id: int, new_node_id: int) -> None:
        """A SuperNode restart: the node comes back (listed again) under ``new_node_id``, state empty.

        ``new_node_id == node_id`` is a restart under SuperNode authentication (the id comes
        with the node's key).
        """
        ctx = self.context(node_id)
        ctx.node_id, ctx.state = new_node_id, RecordDict()
        del self._contexts[node_id]
        self._contexts[new_node_id] = context_to_proto(ctx).SerializeToString()
        self._killed.discard(node_id)
        if node_id in self.node_ids:
            self.node_ids[self.node_ids.index(node_id)] = new_node_id
        else:
            self.node_ids.append(new_node_id)

    def kill(self, node_id: int) -> None:
        """The node's process dies; what Flower's SuperLink then does, without the wait.

        The node stays listed until a message to it is answered by the SuperLink's own
        ``NODE_UNAVAILABLE`` error reply (sender ``SUPERLINK_NODE_ID``, made by Flower's
        ``create_message_error_unavailable_res_message``); then it is no longer listed.
        """
        self._killed.add(node_id)

    def disconnect(self, node_id: int) -> None:
        """The node leaves (it is no longer listed by ``get_node_ids``; messages to it fail)."""
        self.node_ids.remove(node_id)
        del self._contexts[node_id]

    def _execute(self, message: Message) -> Message | None:
        node_id = message.metadata.dst_node_id
        if node_id in self._killed:
            if node_id in self.node_ids:
                self.node_ids.remove(node_id)
            return create_message_error_unavailable_res_message(message.metadata, "node_unavail")
        context = self.context(node_id)
        try:
            reply = self.client_app(message, context)
        except Exception as ex:
            reason = str(type(ex)) + ":<'" + str(ex) + "'>"
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason), reply_to=message)
        else:
            self._contexts[node_id] = context_to_proto(context).SerializeToString()
        if self.reply_hook is not None:
            reply = self.reply_hook(node_id, reply)
        return reply
