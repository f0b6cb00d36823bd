"""The server's side of secure aggregation (``DistributedLion(secure=True)``, ``strategy.secure``).

One round, and where each step is:

1. **Keys, once per node and epoch** (:meth:`SecureRounds.prepare`, in ``configure_train``): a
   sampled node without keys (new, connected under a new node id, or after a resume) gets a
   ``keys`` query and answers its public mask key. A node that fails it is left out of the round
   (logged by name). A resumed run re-keys every node: no client masks a round twice under one key.
2. **Masked uploads** (:meth:`SecureRounds.train_record`): each train message names the round's
   participants, their public mask keys, b = ⌈log₂(n+1)⌉ and the mask graph's degree; the client
   uploads b bit planes: its signs, its pairwise masks and a self-mask of its own
   (:mod:`flower_dlion.clients.secure_client`).
3. **Unmasking** (:meth:`SecureRounds.unmask`, in ``aggregate_train``; one query round trip every
   round): the valid uploads are the survivors; every other participant (no reply, an error, a
   rejected or late reply) is dropped. With at least 3 survivors, each is sent an ``unmask`` query
   naming the survivors and the dropped, and answers its self-mask seed and its round seeds with
   its dropped neighbours. The server sums the survivors' uploads mod 2ᵇ bit-sliced
   (:mod:`flower_dlion.secure.masking`) and takes off their self-masks and their masks with the
   dropped: the counts, which go to the same aggregation as the plain vote
   (:func:`flower_dlion.strategies.server_delta.counts_delta`): the same Δ, bit for bit. A survivor that
   does not answer fails the round (its upload cannot be called dropped: it may have revealed its
   self-mask already).

What the server learns: the per-coordinate counts of the survivors, nothing of one client's
signs in any round, whatever it keeps (docs/USER_GUIDE.md, "Secure aggregation", has the threat model,
the tests that attack each point, and what it gives up).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from ..protocol import SECURE, error_text, message_bytes
from ..secure import masking
from .nodes import HELLO_TYPE
from .options import SecureOptions
from .server_state import Round, Unmasked, ValidReply

__all__ = ["KeyedNode", "SecureRoundFailed", "SecureRounds"]


class SecureRoundFailed(RuntimeError):
    """The round's masked sum cannot be unmasked (too few survivors, a survivor's reveals missing): no update."""


@dataclass
class KeyedNode:
    """What the server knows of one node's key: its epoch, its public half, and the node id it answered as."""

    epoch: int
    mask_public: bytes
    node_id: int


class SecureRounds:
    """Keys, the round's masking record and the unmasking, for one strategy.

    Parameters
    ----------
    options : SecureOptions
        ``secure_degree`` (the mask graph's).
    node_of : callable (key -> node id or None)
        The node id a partition key is connected as (the strategy's node registry).
    run_key : callable (() -> str)
        The run's key (the masks are bound to it).

    """

    def __init__(
        self, options: SecureOptions, node_of: Callable[[int], int | None], run_key: Callable[[], str]
    ) -> None:
        self.options = options
        self.node_of = node_of
        self.run_key = run_key
        self.keyed: dict[int, KeyedNode] = {}  # partition key → its current key
        self.epochs: dict[int, int] = {}  # partition key → its last epoch (a re-keyed node gets the next)
        self.query_timeout = 600.0
        self.bytes_up = self.bytes_down = 0  # bytes of the queries of the round in progress
        self.round_trips = 0  # query round trips of the round in progress

    @staticmethod
    def nodes_needed(min_train_nodes: int) -> tuple[int, str]:
        """The nodes every secure round needs (``min_train_nodes``, at least ``masking.MIN_PARTICIPANTS``), and why.

        The strategy waits for them before a round samples (:meth:`~.nodes.Nodes.discover`) and stops
        the run when they do not come: with fewer, no round could mask (a masked round of two would
        show each node the other's signs) or it would mask with fewer than the run asked for.
        """
        need = max(masking.MIN_PARTICIPANTS, min_train_nodes)
        return need, (
            f"secure aggregation needs at least {need} nodes a round (min_train_nodes = {min_train_nodes}, "
            "run config 'min-train-nodes')"
        )

    # ------------------------------------------------------------------ 1. keys
    def prepare(self, grid: Grid, nodes: dict[int, int], rnd: Round) -> list[tuple[int, int]]:
        """Key the sampled nodes (node id → key) that need it; the (node id, key) that mask this round.

        Sets ``rnd.participants``; none mask (an empty list) when fewer than 3 can.
        """
        self.bytes_up = self.bytes_down = self.round_trips = 0
        ready = self._keyed(grid, nodes, rnd.server_round)
        if len(ready) < masking.MIN_PARTICIPANTS:
            why = "round %d: %d nodes can mask, a secure round needs %d: no train message sent"
            log(WARNING, why, rnd.server_round, len(ready), masking.MIN_PARTICIPANTS)
            return []
        rnd.participants = sorted(ready.values())
        return list(ready.items())

    def _keyed(self, grid: Grid, nodes: dict[int, int], server_round: int) -> dict[int, int]:
        """Key the nodes that need it (no key, or one given under another node id); the nodes with keys."""
        need = {n: k for n, k in nodes.items() if k not in self.keyed or self.keyed[k].node_id != n}
        for key in need.values():
            self.keyed.pop(key, None)
        for key, record in self._ask(grid, need, server_round, self._keys_request).items():
            node_id = next(n for n, k in need.items() if k == key)
            public, epoch = record.get("mask-public"), record.get("epoch")
            if not isinstance(public, bytes) or len(public) != 32 or epoch != self.epochs[key]:
                why = "round %d: node %d's secure key is malformed (a 32-byte key of epoch %d expected): left out"
                log(WARNING, why, server_round, node_id, self.epochs[key])
                continue
            self.keyed[key] = KeyedNode(self.epochs[key], public, node_id)
        ready = {node_id: key for node_id, key in nodes.items() if key in self.keyed}
        if len(ready) < len(nodes):
            left = sorted(key for key in nodes.values() if key not in self.keyed)
            log(WARNING, "round %d: partitions %s have no secure keys and sit this round out", server_round, left)
        return ready

    def _keys_request(self, key: int) -> dict[str, Any]:
        epoch = self.epochs.get(key, -1) + 1
        self.epochs[key] = epoch
        return {"step": "keys", "epoch": epoch}

    # ------------------------------------------------------------------ 2. the round's record
    def record_for(self, key: int, rnd: Round) -> RecordDict:
        """The records a node's train message adds: ``dlion.secure`` (:meth:`train_record`)."""
        return RecordDict({SECURE: self.train_record(key, rnd.participants)})

    def train_record(self, key: int, participants: list[int]) -> ConfigRecord:
        """The ``dlion.secure`` record of one node's train message: who masks with whom, and how."""
        return ConfigRecord(
            {
                "state-key": self.run_key(),
                "epoch": self.keyed[key].epoch,
                "me": key,
                "participants": participants,
                "mask-publics": [self.keyed[k].mask_public for k in participants],
                "bits": masking.mask_bits(len(participants)),
                "degree": self._degree(len(participants)),
            }
        )

    def _degree(self, n: int) -> int:
        degree = self.options.secure_degree
        return 0 if degree >= n - 1 else degree

    # ------------------------------------------------------------------ 3. unmask
    def counts(
        self, grid: Grid, rnd: Round, errors: list[int], valid: list[ValidReply],
        partition_of: Callable[[int], int], d: int,
    ) -> tuple[list[ValidReply], Unmasked | None]:  # fmt: skip
        """The round's valid replies and their unmasked counts, or ([], None) when they cannot be unmasked.

        A node that answered with an error (``errors``: their senders; e.g. it lost its key, or
        refused to mask) is re-keyed before it masks again.
        """
        for node_id in errors:
            if (key := partition_of(node_id)) >= 0:
                self.keyed.pop(key, None)
        if not valid:
            return valid, None
        uploads = {partition_of(r.node_id): r.upload.data for r in valid}
        buffers = {partition_of(r.node_id): r.masked_buffers for r in valid} if rnd.buffer_sync else None
        unmasked = self.unmask(grid, rnd, uploads, d, buffers)
        return (valid, unmasked) if unmasked is not None else ([], None)

    def unmask(
        self, grid: Grid | None, rnd: Round, uploads: dict[int, bytes], d: int, buffers: dict[int, bytes] | None = None
    ) -> Unmasked | None:
        """The counts' bit planes (b, ⌈d/8⌉) of the survivors' uploads (partition key → masked planes).

        ``uploads`` are the valid replies' (the survivors); every other participant is dropped.
        ``buffers`` (a buffer round: partition key → masked buffer moments): their mean too.
        None, logged with the reason (:class:`SecureRoundFailed`'s), when the sum cannot be
        unmasked: fewer than 3 survivors, or a survivor whose reveals are missing or malformed.
        The round then applies no update.
        """
        assert grid is not None
        try:
            return self._unmask(grid, rnd.server_round, rnd.participants, uploads, d, buffers)
        except SecureRoundFailed as err:
            log(WARNING, "round %d: %s; x unchanged", rnd.server_round, err)
            return None

    def _unmask(
        self, grid: Grid, t: int, participants: list[int], uploads: dict[int, bytes], d: int,
        buffers: dict[int, bytes] | None,
    ) -> Unmasked:  # fmt: skip
        """:meth:`unmask`, raising :class:`SecureRoundFailed`."""
        bits = masking.mask_bits(len(participants))
        survivors, dropped = sorted(uploads), sorted(set(participants) - set(uploads))
        if len(survivors) < masking.MIN_SURVIVORS:
            raise SecureRoundFailed(
                f"{len(survivors)} survivor(s) of {len(participants)}, {masking.MIN_SURVIVORS} needed: "
                "nothing unmasked (with fewer, each survivor would read the others' signs from Δ)"
            )
        reveals = self._reveals(grid, t, participants, survivors, dropped)
        acc = masking.sum_planes([np.frombuffer(uploads[k], dtype=np.uint8) for k in survivors], d, bits)
        fixed = None if buffers is None else sum(np.frombuffer(buffers[k], dtype=np.uint64) for k in survivors)
        for u in survivors:  # take off what u added: its self-mask (+), and ±M with each dropped neighbour v
            own, pairs = reveals[u]
            for sigma, seed in [(1, own)] + [(1 if u < v else -1, s) for v, s in pairs.items()]:
                masking.add_planes_(acc, masking.mask_stream(seed, d, bits), subtract=sigma > 0)
                if fixed is not None:
                    mask = masking.buffer_mask(seed, fixed.size)
                    fixed = fixed - mask if sigma > 0 else fixed + mask
        if dropped:
            log(INFO, "round %d: unmasked without %s (their masks with the survivors revealed for this round)", t,
                dropped)  # fmt: skip
        mean = None if fixed is None else masking.from_fixed_mean(np.asarray(fixed, dtype=np.uint64), len(survivors))
        return Unmasked(masking.planes_bytes(acc, d), mean)

    def _reveals(
        self, grid: Grid, t: int, participants: list[int], survivors: list[int], dropped: list[int]
    ) -> dict[int, tuple[bytes, dict[int, bytes]]]:
        """Each survivor's self-mask seed and round seeds with its dropped neighbours (all survivors', or a failure)."""
        degree = self._degree(len(participants))
        expected = {u: [v for v in masking.neighbours(participants, u, degree, [t]) if v in dropped] for u in survivors}

        def request(key: int) -> dict[str, Any]:
            return {"step": "unmask", "round": t, "me": key, "survivors": survivors, "dropped": dropped}

        asked = {node_id: k for k in survivors if (node_id := self.node_of(k)) is not None}
        out: dict[int, tuple[bytes, dict[int, bytes]]] = {}
        for key, record in self._ask(grid, asked, t, request).items():
            own, owners, seeds = record.get("self"), record.get("owners"), record.get("seeds")
            ok = isinstance(own, bytes) and len(own) == masking.SEED_BYTES and record.get("round") == t
            ok = ok and owners == expected[key] and isinstance(seeds, list) and len(seeds) == len(expected[key])
            ok = ok and all(isinstance(s, bytes) and len(s) == masking.SEED_BYTES for s in seeds)  # type: ignore[union-attr]
            if not ok:
                log(WARNING, "round %d: partition %d's reveals are malformed (owners %s, expected %s)", t, key,
                    owners, expected[key])  # fmt: skip
                continue
            out[key] = (own, dict(zip(owners, seeds, strict=True)))  # type: ignore[arg-type]
        if len(out) < len(survivors):
            missing = sorted(set(survivors) - set(out))
            raise SecureRoundFailed(
                f"survivors {missing} did not reveal their masks of round {t}: the sum stays masked "
                "(a survivor cannot be called dropped once it may have revealed its self-mask)"
            )
        return out

    def round_bytes(self) -> dict[str, int]:
        """The round's queries: their bytes each way and their round trips (the round's metrics add them in)."""
        return {
            "secure-bytes-up": self.bytes_up,
            "secure-bytes-down": self.bytes_down,
            "secure-round-trips": self.round_trips,
        }

    # ------------------------------------------------------------------ queries
    def _ask(
        self, grid: Grid, nodes: dict[int, int], server_round: int, request: Callable[[int], dict[str, Any]]
    ) -> dict[int, ConfigRecord]:
        """Send each node (node id → key) its ``dlion.secure`` query; the valid answers by key, the others logged."""
        if not nodes:
            return {}
        run_key = self.run_key()
        sent = []
        for node_id, key in nodes.items():
            content = RecordDict({SECURE: ConfigRecord({"state-key": run_key, **request(key)})})
            sent.append(
                Message(
                    content=content, dst_node_id=node_id, message_type=HELLO_TYPE, group_id=f"secure-{server_round}"
                )
            )
        self.bytes_down += sum(message_bytes(m) for m in sent)
        self.round_trips += 1
        answers = {}
        for reply in grid.send_and_receive(sent, timeout=self.query_timeout):
            self.bytes_up += message_bytes(reply)
            node_id = reply.metadata.src_node_id
            key = nodes.get(node_id)
            record = None if reply.has_error() or SECURE not in reply.content else reply.content[SECURE]
            if key is None or not isinstance(record, ConfigRecord):
                why = error_text(reply) if reply.has_error() else f"no '{SECURE}' record"
                log(WARNING, "round %d: node %d's secure-aggregation answer is refused: %s", server_round, node_id, why)
                continue
            answers[key] = record
        return answers

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The epochs given so far (no key: a resumed run re-keys every node, see :meth:`load_state_dict`)."""
        return {"epochs": dict(self.epochs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`: every node gets a new key (and epoch) before it masks again.

        The rounds after the checkpoint may have been masked already (the run that wrote it went on);
        masking them again under the same keys would repeat their masks on other signs.
        """
        self.epochs = {int(k): int(v) for k, v in state["epochs"].items()}
        self.keyed = {}
