"""The nodes a strategy knows: greeted once per node id, known by their partition, sampled by round.

Flower's node ids are random per run and new after a SuperNode restarts, so our strategies know
a node by a *key*: the ``partition-id`` of its node config, or, without one, its node id. Each new
node id gets one hello (a ``query.dlion`` message, ``protocol.HELLO``) and says in its answer which
partition it trains on and which version of the model it holds; :class:`Nodes` keeps the two maps
(node id ↔ key), the nodes refused for good, the nodes left out (their replies have the wrong
layout: :meth:`Nodes.leave_out`), and samples the connected keys for a round with
``numpy.random.default_rng([sample_seed, round])``: the same partitions in every run with the same
seed, whatever the node ids, and after a resume. What a hello carries and how its answer is
checked is the strategy's (:class:`HelloHooks`).

Before a round samples, enough nodes must be connected (``min_available_nodes``) and able to take
part (as many as the strategy's every round needs: secure aggregation's); :meth:`Nodes.discover`
waits for them at most ``wait_for_nodes`` seconds, then stops the run (:class:`RunStopped`) naming
both counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from logging import INFO, WARNING
from typing import Any, Protocol

import numpy as np
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from ..params import LayoutError, ModelSpec
from ..protocol import HELLO, HELLO_ACTION, OTHER_APP, RejectedReply, error_text
from .replies import CheckedReplies, reply_node
from .run_stops import RunStopped, nodes_text, short_reason, whole_reason

__all__ = ["CLIENT_LAYOUT_ERRORS", "HELLO_TYPE", "HelloHooks", "Nodes", "described_model", "wrong_layout"]

HELLO_TYPE = f"{MessageType.QUERY}.{HELLO_ACTION}"
CLIENT_LAYOUT_ERRORS = ("server model layout",)
"""In a client's error reason when its model has another layout than the server's (``clients/replica.py``)."""

_NO_CLIENT = (
    "its ClientApp has no DLionClient to answer the hello: add `dlion = DLionClient(app, Net)` "
    "to your client_app.py and call `dlion.train(msg, context, batches)` in its train handler. If it "
    f"has one, the node runs another app's code: {OTHER_APP}"
)


def described_model(
    node_id: int,
    record: ConfigRecord | MetricRecord,
    reference: ModelSpec | None,
    initial: dict[str, Any] | None,
    checksums: dict[str, int] | None = None,
) -> ModelSpec | None:
    """The model a hello describes (``record["model"]``), checked; None for a hello without one.

    The description must match ``reference`` (the federation's model, once known), else the
    ``initial`` arrays (name by name, shape and dtype).

    Raises
    ------
    RejectedReply
        For good (``final``): the description cannot be read or does not match; the message names
        the first differing tensor.

    """
    if "model" not in record:
        return None
    try:
        spec = ModelSpec.decode(record["model"])  # type: ignore[arg-type]
    except (ValueError, TypeError) as err:
        raise RejectedReply(str(err), final=True) from err
    try:
        if reference is not None:
            reference.check_same(spec, theirs=f"node {node_id}", ours="the server")
        else:
            assert initial is not None, "a hello before configure_train"
            spec.check_arrays(initial, checksums)
    except LayoutError as err:
        why = f"its model does not match the {'federation' if reference else 'initial arrays'}: {err}"
        raise RejectedReply(why, final=True) from err
    return spec


class HelloHooks(Protocol):
    """What the strategy says in a hello and makes of its answer, and how many nodes it waits for."""

    min_available_nodes: int

    def _nodes_needed(self) -> tuple[int, str] | None:
        """The nodes every round needs to take part, and why (e.g. secure aggregation's); None: no such floor."""

    def _hello_config(self, server_round: int) -> ConfigRecord:
        """What a hello carries."""

    def _check_hello(self, node_id: int, record: ConfigRecord | MetricRecord) -> None:
        """Raise :class:`RejectedReply` for an answer the strategy cannot work with."""

    def _on_new_node(self, pid: int, node_id: int, version: int, previous: int | None) -> None:
        """A node introduced itself (``previous``: the node id its key had before)."""


class Nodes:
    """The node registry of one strategy: who is connected, under which key, and who is sampled.

    Parameters
    ----------
    hooks : HelloHooks
        The strategy: what a hello carries, how its answer is checked, and the nodes to wait for
        before any round samples (its ``min_available_nodes``).
    reject : callable (node id, reason) -> None
        Called with each failed hello (the strategy counts it towards stopping the run).
    wait_for_nodes : float | None (default: None)
        Seconds :meth:`discover` waits for enough nodes before it stops the run; None: ``query_timeout``.

    Attributes
    ----------
    query_timeout : float
        Seconds to wait for the answers to a hello (``start`` sets it to the round timeout).

    """

    def __init__(
        self, hooks: HelloHooks, reject: Callable[[int, str], None], wait_for_nodes: float | None = None
    ) -> None:
        self.hooks = hooks
        self.reject = reject
        self.query_timeout = 600.0  # seconds to wait for the answers to a hello
        self.wait_for_nodes = wait_for_nodes
        self.forget()

    @property
    def wait_for_nodes(self) -> float | None:
        """Seconds to wait for enough nodes before a round stops the run (None: ``query_timeout``)."""
        return self._wait_for_nodes

    @wait_for_nodes.setter
    def wait_for_nodes(self, seconds: float | None) -> None:
        ok = seconds is None or (isinstance(seconds, (int, float)) and not isinstance(seconds, bool))
        if not ok or (seconds is not None and not (math.isfinite(seconds) and seconds >= 0)):
            raise ValueError(f"wait_for_nodes must be a finite number of seconds >= 0, or None, got {seconds!r}")
        self._wait_for_nodes = seconds

    def forget(self) -> None:
        """Forget every node id (after a resume: the nodes say hello again)."""
        self.pid_of: dict[int, int] = {}  # node id → its key (partition id, or its node id)
        self.node_of: dict[int, int] = {}  # key → node id
        self.refused: dict[int, str] = {}  # node id → why its hello was refused (not asked again)
        self.left_out: dict[int, str] = {}  # node id → why its replies have the wrong layout (until a new hello)
        self.greeted = False  # a node has answered a hello usefully in this process

    def partition_of(self, node_id: int) -> int:
        """The key a node is known by: its partition id, or its node id (-1 if unknown)."""
        return self.pid_of.get(node_id, -1)

    def reply_node(self, reply: Message, sent: Iterable[Message]) -> tuple[int, int]:
        """The node a reply speaks for and its key (-1 if unknown); the SuperLink's error for it: forgotten.

        :func:`~.replies.reply_node`; a node the SuperLink answered for (it stopped heartbeating) is
        forgotten (:meth:`forget_node`), so that it is greeted again (hello) when it reconnects.
        """
        node_id, lost = reply_node(reply, sent)
        return node_id, self.forget_node(node_id) if lost else self.partition_of(node_id)

    def forget_node(self, node_id: int) -> int:
        """Forget a node id (a later hello greets it anew); returns its key, -1 if unknown."""
        pid = self.pid_of.pop(node_id, -1)
        if self.node_of.get(pid) == node_id:
            del self.node_of[pid]
        return pid

    def log_refused(self, server_round: int, checked: CheckedReplies, outbox: list[Message]) -> None:
        """Log each refused reply (or leave its node out: wrong layout); log the sampled nodes without one.

        A node the SuperLink answered for is forgotten (:meth:`forget_node`); the sampled nodes of
        ``outbox`` (the round's train messages) without a reply get a line each.
        """
        for reply, err in checked.refused:
            node_id, pid = reply.node_id, reply.partition
            if reply.lost:
                self.forget_node(node_id)
            if not (wrong_layout(reply.msg, err) and self.leave_out(node_id, pid, str(err), server_round)):
                line = "round %d: rejected reply from node %d (partition %d): %s"
                log(WARNING, line, server_round, node_id, pid, err)
        for msg in outbox:
            if (node_id := msg.metadata.dst_node_id) not in checked.answered:
                pid = self.partition_of(node_id)
                log(WARNING, "round %d: no reply from node %d (partition %d)", server_round, node_id, pid)

    def sample(
        self, grid: Grid, server_round: int, fraction: float, minimum: int, seed: list[int], what: str
    ) -> list[int]:
        """Node ids of ``max(minimum, ⌊fraction · N⌋)`` of the N connected keys, drawn by ``default_rng(seed)``.

        ``what`` names the sample in the log line ("configure_train", "configure_evaluate").
        """
        nodes = self.discover(grid, server_round)
        pids = sorted(self.pid_of[n] for n in nodes)
        k = min(len(pids), max(minimum, int(len(pids) * fraction)))
        if k < len(pids):
            pids = sorted(np.random.default_rng(seed).choice(pids, k, replace=False))
        log(INFO, "%s: sampled %d nodes (out of %d)", what, len(pids), len(nodes))
        return [self.node_of[int(p)] for p in pids]

    def leave_out(self, node_id: int, pid: int, why: str, server_round: int) -> bool:
        """Leave a node whose reply has the wrong layout (``why``) out of sampling until it says hello again.

        Logged once, one WARNING line naming the node, its partition and ``why``. The node id is
        forgotten: it is greeted again when it comes back under a new node id, after it left (no
        longer connected), or after a resume (:meth:`forget`). Returns False (nothing done) for a
        node already left out.
        """
        if node_id in self.left_out:
            return False
        self.left_out[node_id] = why
        self.pid_of.pop(node_id, None)
        if self.node_of.get(pid) == node_id:
            del self.node_of[pid]
        line = (
            "round %d: rejected reply from node %d (partition %d) of the wrong layout: %s. The node is left out of "
            "sampling until it says hello again (a new node id, or a resume)"
        )
        log(WARNING, line, server_round, node_id, pid, why)
        return True

    def discover(self, grid: Grid, server_round: int) -> list[int]:
        """Wait for enough nodes; say hello to new node ids; the connected nodes we know (that can take part).

        Enough: ``min_available_nodes`` connected, and as many as every round needs able to take
        part (the hooks' ``_nodes_needed``: secure aggregation's). The wait polls every second for
        at most ``wait_for_nodes`` seconds (None: ``query_timeout``).

        Raises
        ------
        RunStopped
            Before any node has answered a hello usefully, when every connected node has now
            answered its hello with an error or a refusal (at least one of them an error: a
            model that does not match is the strategy's to report). After the wait, when there
            are still too few nodes: the message names what is needed and what there is.

        """
        least, needs = self.hooks.min_available_nodes, self.hooks._nodes_needed()
        need = 0 if needs is None else needs[0]
        wait = self.query_timeout if self.wait_for_nodes is None else self.wait_for_nodes
        start, known, told = time.monotonic(), list[int](), ""  # told: the counts of the last line logged
        greeted: set[int] | None = None  # the connected nodes of the last hellos
        while True:
            connected = list(grid.get_node_ids())
            self.left_out = {n: why for n, why in self.left_out.items() if n in connected}  # gone: greeted again
            enough = len(connected) >= max(least, need)
            if enough and greeted != set(connected):  # hellos once for each set of connected nodes
                known, greeted = self._greet_new(grid, connected, server_round), set(connected)
                if len(known) >= need:
                    return known
            waited = time.monotonic() - start
            if waited >= wait:
                raise RunStopped(self._too_few(connected, known if enough else [], least, needs, wait), server_round)
            have = f"{len(connected)} connected" + (f", {len(known)} can take part" if enough else "")
            if have != told:  # a line when the counts change, not every second
                line = "waiting for nodes: %s; %s: the run stops in %.0f s unless they come"
                log(INFO, line, have, self._needed_text(least, needs), wait - waited)
                told = have
            time.sleep(min(1.0, wait - waited))

    @staticmethod
    def _needed_text(least: int, needs: tuple[int, str] | None) -> str:
        """What sets the nodes a round waits for: ``min_available_nodes``, or the strategy's own floor."""
        if needs is not None and needs[0] >= least:
            return needs[1]
        return (
            f"min_available_nodes = {least} nodes must be connected before a round samples "
            "(run config 'min-available-nodes')"
        )

    def _too_few(
        self, connected: list[int], known: list[int], least: int, needs: tuple[int, str] | None, wait: float
    ) -> str:
        """Why :meth:`discover` stops the run: what is needed, what there is after ``wait`` seconds, and why."""
        after = f"after waiting {wait:g} s (wait_for_nodes, by default the round timeout)"
        if len(connected) < least and (needs is None or needs[0] < least):
            return f"{self._needed_text(least, None)}; {len(connected)} {_are(len(connected))} connected {after}"
        assert needs is not None
        if len(connected) < needs[0]:
            return f"{needs[1]}; {len(connected)} {_are(len(connected))} connected {after}"
        by_reason: dict[str, list[int]] = {}
        for n in connected:
            if n not in known:
                why = "its hello got no useful answer"
                why = f"its hello was refused: {self.refused[n]}" if n in self.refused else why
                why = f"left out, wrong layout: {self.left_out[n]}" if n in self.left_out else why
                by_reason.setdefault(why, []).append(n)
        reasons = "; ".join(f"{nodes_text(nodes)}: {why}" for why, nodes in list(by_reason.items())[:3])
        return f"{needs[1]}; {len(known)} of the {len(connected)} connected can take part {after} ({reasons})"

    def _greet_new(self, grid: Grid, connected: list[int], server_round: int) -> list[int]:
        """Say hello to the connected node ids not greeted yet; the connected nodes we know."""
        new = [n for n in connected if n not in self.pid_of and n not in self.refused and n not in self.left_out]
        failed: dict[int, str] = {}  # node id → why its hello was rejected now
        if new:
            content = RecordDict({HELLO: self.hooks._hello_config(server_round)})
            group = f"hello-{server_round}"
            hellos = [Message(content=content, dst_node_id=n, message_type=HELLO_TYPE, group_id=group) for n in new]
            for reply in grid.send_and_receive(hellos, timeout=self.query_timeout):
                node_id, why = self._greet(reply, hellos, new, server_round)
                if why is not None:
                    failed[node_id] = why
        known = [n for n in connected if self.pid_of.get(n) is not None and self.node_of[self.pid_of[n]] == n]
        if new and not known and not self.greeted:
            self._stop_if_no_hello_was_useful(connected, failed, server_round)
        return known

    def _stop_if_no_hello_was_useful(self, connected: list[int], failed: dict[int, str], server_round: int) -> None:
        """Raise :class:`RunStopped` when every connected node's hello failed, one at least with an error."""
        why_of = {n: failed.get(n, self.refused.get(n)) for n in connected}
        if any(why is None for why in why_of.values()) or all(n in self.refused for n in failed):
            return  # a node has not answered (the rounds count it), or the refusals are the strategy's to report
        by_reason: dict[str, list[int]] = {}
        for node_id, why in why_of.items():
            by_reason.setdefault(str(why), []).append(node_id)
        reasons = "; ".join(f"{nodes_text(nodes)}: {why}" for why, nodes in by_reason.items())
        raise RunStopped(
            f"no node answered the hello usefully (round {server_round}): {reasons}. Each node's ClientApp "
            "answers the strategy's hello with its DLionClient (`DLionClient(app, Net)` registers the handler "
            "for the query message): see the clients' logs for these errors",
            server_round,
        )

    def _greet(
        self, reply: Message, hellos: list[Message], new: list[int], server_round: int
    ) -> tuple[int, str | None]:
        """Take one answer to a hello: the node's key and version, or a logged refusal.

        Returns the node's id and, for a refused hello, why (None when it was taken).
        """
        node_id, _ = self.reply_node(reply, hellos)
        try:
            key, version = self._read_hello(reply, node_id, new)
        except (RejectedReply, KeyError, TypeError) as err:
            if isinstance(err, RejectedReply) and err.final:
                self.refused[node_id] = str(err)
            log(WARNING, "round %d: rejected hello from node %d: %s", server_round, node_id, err)
            reason = whole_reason(reply, err)
            self.reject(node_id, f"hello: {reason}")
            return node_id, short_reason(reason)
        previous = self.node_of.get(key)
        if previous is not None:
            self.pid_of.pop(previous, None)
        self.pid_of[node_id] = key
        self.node_of[key] = node_id
        self.greeted = True
        self.hooks._on_new_node(key, node_id, version, previous)
        return node_id, None

    def _read_hello(self, reply: Message, node_id: int, new: list[int]) -> tuple[int, int]:
        """The key and version an answer to a hello gives; :class:`RejectedReply` when it gives none."""
        if reply.has_error() and f"No query function registered with name '{HELLO_ACTION}'" in reply.error.reason:
            raise RejectedReply(_NO_CLIENT, final=True)
        if reply.has_error():
            raise RejectedReply(error_text(reply))
        if node_id not in new:
            raise RejectedReply("no hello was sent to this node")
        record = reply.content[HELLO] if HELLO in reply.content else None
        if not isinstance(record, (ConfigRecord, MetricRecord)):
            raise RejectedReply(f"no '{HELLO}' record with the node's partition-id and version")
        pid, version = record.get("partition-id"), record.get("version")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= -1 for v in (pid, version)):
            raise RejectedReply(f"partition-id {pid!r} / version {version!r} are not valid integers")
        key = pid if pid >= 0 else node_id
        owner = self.node_of.get(key)
        if pid < 0 and owner is not None and owner != node_id:
            raise RejectedReply(f"node id {node_id} is already the partition id of node {owner}")
        self.hooks._check_hello(node_id, record)
        return key, version


def wrong_layout(msg: Message, err: RejectedReply) -> bool:
    """Whether a rejected reply shows that its node's model has another layout than the federation's.

    The server's own check marks it (``RejectedReply(final=True)``: an array of another shape); a
    client's error reply says so in its reason (:data:`CLIENT_LAYOUT_ERRORS`).
    """
    if err.final:
        return True
    return msg.has_error() and any(what in msg.error.reason for what in CLIENT_LAYOUT_ERRORS)


def _are(n: int) -> str:
    """The verb for ``n`` nodes: "is" for one, "are" for any other count."""
    return "is" if n == 1 else "are"
