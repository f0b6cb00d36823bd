"""The server's side of secure aggregation (``DistributedLion(secure=True)``, ``strategy.secure``).

One round, and where each step is:

1. **Keys, once per node and epoch** (:meth:`SecureRounds.prepare`, in ``configure_train``): a
   sampled node without keys (new, restarted, or whose key was recovered after a dropout) gets a
   ``keys`` query and answers its public mask and share keys; then a ``shares`` query names the
   holders (every other keyed node) with their public share keys, and the node answers its mask
   key's Shamir shares, each sealed for its holder. The server keeps the sealed shares; it cannot
   open them. A node that fails either query is left out of the round (logged by name).
2. **Masked uploads** (:meth:`SecureRounds.train_record`): each train message names the round's
   participants, their public mask keys, b = ⌈log₂(n+1)⌉ and the mask graph's degree; the client
   uploads b bit planes (:mod:`flower_dlion.clients.secure_client`).
3. **Unmasking** (:meth:`SecureRounds.unmask`, in ``aggregate_train``): the valid uploads are
   summed mod 2ᵇ bit-sliced (:mod:`flower_dlion.secure.masking`). If every participant replied,
   the masks cancel and the sum is the counts. Otherwise the server sends the survivors an
   ``unmask`` query naming the survivors and the dropped with the sealed shares each holds,
   recovers each dropped node's mask key from t opened shares (checked against its public key),
   takes the dropped node's masks off the survivors' sum, and marks the recovered key spent (the
   node is re-keyed before it masks again). The counts go to the same aggregation as the plain
   vote (:func:`flower_dlion.server_delta.counts_delta`): the same Δ, bit for bit.

What the server learns: the per-coordinate counts of the survivors, nothing of one client's
signs (docs/GUIDE.md, "Secure aggregation", has the threat model and what it gives up).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from ..protocol import SECURE, error_text, message_bytes
from ..secure import masking
from ..secure.shares import SHARE_BYTES, recover_mask_key, threshold_for
from .nodes import HELLO_TYPE
from .options import SecureOptions
from .server_state import Round, Unmasked

__all__ = ["KeyedNode", "SecureRoundFailed", "SecureRounds"]


class SecureRoundFailed(RuntimeError):
    """The round's masked sum cannot be unmasked (too few survivors or shares): the round applies no update."""


@dataclass
class KeyedNode:
    """What the server knows of one node's keys: public halves and the sealed shares of its mask key."""

    epoch: int
    mask_public: bytes
    share_public: bytes
    sealed: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # holder → (sealed share, its share key)
    threshold: int = 0  # shares needed to recover the key


class SecureRounds:
    """Keys, the round's masking record and the unmasking, for one strategy.

    Parameters
    ----------
    options : SecureOptions
        ``secure_threshold`` (t as a share of a key's holders) and ``secure_degree``.
    node_of : callable (key -> node id or None)
        The node id a partition key is connected as (the strategy's node registry).
    run_key : callable (() -> str)
        The run's key (the masks and the sealed shares are bound to it).

    """

    def __init__(
        self, options: SecureOptions, node_of: Callable[[int], int | None], run_key: Callable[[], str]
    ) -> None:
        self.options = options
        self.node_of = node_of
        self.run_key = run_key
        self.keyed: dict[int, KeyedNode] = {}  # partition key → its keys (complete: sealed shares kept)
        self.epochs: dict[int, int] = {}  # partition key → its last epoch (a re-keyed node gets the next)
        self.query_timeout = 600.0
        self.bytes_up = self.bytes_down = 0  # bytes of the queries of the round in progress

    # ------------------------------------------------------------------ 1. keys
    def prepare(self, grid: Grid, nodes: dict[int, int], rnd: Round) -> list[tuple[int, int]]:
        """Key the sampled nodes (node id → key) that need it; the (node id, key) that mask this round.

        Sets ``rnd.participants``; none mask (an empty list) when fewer than 3 can.
        """
        ready = self._keyed(grid, nodes, rnd.server_round)
        if len(ready) < masking.MIN_PARTICIPANTS:
            why = "round %d: %d nodes can mask, a secure round needs %d: no train message sent"
            log(WARNING, why, rnd.server_round, len(ready), masking.MIN_PARTICIPANTS)
            return []
        rnd.participants = sorted(ready.values())
        return list(ready.items())

    def _keyed(self, grid: Grid, nodes: dict[int, int], server_round: int) -> dict[int, int]:
        """Key the nodes that need it; the nodes (node id → key) with keys and sealed shares."""
        self.bytes_up = self.bytes_down = 0
        need = {node_id: key for node_id, key in nodes.items() if key not in self.keyed}
        if need:
            answers = self._ask(grid, need, server_round, lambda key: self._keys_request(key))
            fresh = {}
            for key, record in answers.items():
                try:
                    fresh[key] = KeyedNode(
                        int(record["epoch"]), _key_bytes(record["mask-public"]), _key_bytes(record["share-public"])
                    )
                except (KeyError, TypeError, ValueError) as err:
                    log(
                        WARNING,
                        "round %d: node %d's secure keys are malformed (%s)",
                        server_round,
                        need_of(need, key),
                        err,
                    )
            self._seal(grid, {n: k for n, k in need.items() if k in fresh}, fresh, server_round)
        ready = {node_id: key for node_id, key in nodes.items() if key in self.keyed}
        if len(ready) < len(nodes):
            left = sorted(key for key in nodes.values() if key not in self.keyed)
            log(WARNING, "round %d: partitions %s have no secure keys and sit this round out", server_round, left)
        return ready

    def _keys_request(self, key: int) -> dict[str, Any]:
        epoch = self.epochs.get(key, -1) + 1
        self.epochs[key] = epoch
        return {"step": "keys", "epoch": epoch}

    def _seal(self, grid: Grid, need: dict[int, int], fresh: dict[int, KeyedNode], server_round: int) -> None:
        """The ``shares`` query: each fresh node seals its mask key's shares for every other keyed node."""
        known = {**self.keyed, **fresh}

        def request(key: int) -> dict[str, Any]:
            holders = sorted(k for k in known if k != key)
            t = threshold_for(len(holders), self.options.secure_threshold) if len(holders) >= 2 else 0
            fresh[key].threshold = t
            publics = [known[h].share_public for h in holders]
            return {
                "step": "shares",
                "epoch": fresh[key].epoch,
                "me": key,
                "holders": holders,
                "share-publics": publics,
                "threshold": t,
            }

        enough = {n: k for n, k in need.items() if len(known) >= 3}  # at least 2 holders for each key
        if len(enough) < len(need):
            log(
                WARNING, "round %d: %d keyed nodes; secure aggregation needs 3 to share a key", server_round, len(known)
            )
        for key, record in self._ask(grid, enough, server_round, request).items():
            holders, sealed = record.get("holders"), record.get("sealed")
            expected = sorted(k for k in known if k != key)
            if holders != expected or not isinstance(sealed, list) or len(sealed) != len(expected):
                log(
                    WARNING,
                    "round %d: node %d sealed shares for %s, expected %s",
                    server_round,
                    need_of(enough, key),
                    holders,
                    expected,
                )
                continue
            fresh[key].sealed = {
                h: (bytes(box), known[h].share_public) for h, box in zip(expected, sealed, strict=True)
            }
            self.keyed[key] = fresh[key]

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
    def unmask(
        self, grid: Grid | None, rnd: Round, uploads: dict[int, bytes], d: int, buffers: dict[int, bytes] | None = None
    ) -> Unmasked | None:
        """The counts' bit planes (b, ⌈d/8⌉) of the survivors' uploads (partition key → masked planes).

        ``buffers`` (a buffer round: partition key → masked buffer moments): their mean too.
        None, logged with the reason (:class:`SecureRoundFailed`'s), when the sum cannot be unmasked:
        fewer than 2 survivors, or a dropped node's key that cannot be recovered (too few holders
        answered, or their shares do not give its public key). The round then applies no update.
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
            raise SecureRoundFailed(f"{len(survivors)} survivor(s) of {len(participants)}: nothing can be unmasked")
        acc = masking.sum_planes([np.frombuffer(uploads[k], dtype=np.uint8) for k in survivors], d, bits)
        fixed = None if buffers is None else sum(np.frombuffer(buffers[k], dtype=np.uint64) for k in survivors)
        keys = self._recover(grid, t, participants, survivors, dropped) if dropped else {}
        for v in dropped:  # survivor u added +M if u < v, −M otherwise: take it off
            for u in masking.neighbours(participants, v, self._degree(len(participants)), [t]):
                if u in uploads:
                    seed = masking.pair_seed(keys[v], self.keyed[u].mask_public, self.run_key())
                    masking.add_planes_(acc, masking.round_mask(seed, t, d, bits), subtract=u < v)
                    if fixed is not None:
                        mask = masking.buffer_mask(seed, t, fixed.size)
                        fixed = fixed - mask if u < v else fixed + mask
            del self.keyed[v]  # its key is known now: new keys before it masks again
        if dropped:
            log(INFO, "round %d: unmasked without %s (their keys recovered from shares)", t, dropped)
        mean = None if fixed is None else masking.from_fixed_mean(np.asarray(fixed, dtype=np.uint64), len(survivors))
        return Unmasked(masking.planes_bytes(acc, d), mean)

    def _recover(
        self, grid: Grid, server_round: int, participants: list[int], survivors: list[int], dropped: list[int]
    ) -> dict[int, Any]:
        """The dropped nodes' mask keys, from the survivors' opened shares."""

        def request(key: int) -> dict[str, Any]:  # the shares sealed for this holder's current share key
            mine = self.keyed[key].share_public
            owners = [v for v in dropped if self.keyed[v].sealed.get(key, (b"", b""))[1] == mine]
            return {
                "step": "unmask",
                "round": server_round,
                "epoch": self.keyed[key].epoch,
                "me": key,
                "survivors": survivors,
                "dropped": dropped,
                "owners": owners,
                "epochs": [self.keyed[v].epoch for v in owners],
                "share-publics": [self.keyed[v].share_public for v in owners],
                "sealed": [self.keyed[v].sealed[key][0] for v in owners],
            }

        asked = {node_id: k for k in survivors if (node_id := self.node_of(k)) is not None}
        opened: dict[int, list[bytes]] = {v: [] for v in dropped}
        for key, record in self._ask(grid, asked, server_round, request).items():
            owners, shares = record.get("owners"), record.get("shares")
            if not isinstance(owners, list) or not isinstance(shares, list) or len(owners) != len(shares):
                log(WARNING, "round %d: partition %d's opened shares are malformed", server_round, key)
                continue
            for owner, share in zip(owners, shares, strict=True):
                if owner not in opened or not isinstance(share, bytes) or len(share) != SHARE_BYTES:
                    why = "round %d: partition %d's share of partition %s's key is malformed: left out"
                    log(WARNING, why, server_round, key, owner)
                    continue
                opened[owner].append((key, share))
        return {v: self._recovered(server_round, v, opened[v]) for v in dropped}

    def _recovered(self, server_round: int, v: int, opened: list[tuple[int, bytes]]) -> Any:
        """Partition v's mask key from t of its opened shares (holder, share): each t-subset in turn, 64 at most."""
        node = self.keyed[v]
        for subset in itertools.islice(itertools.combinations(opened, node.threshold), 64):
            try:
                return recover_mask_key([share for _, share in subset], node.mask_public, node.threshold)
            except ValueError:
                continue
        holders = sorted(h for h, _ in opened)
        raise SecureRoundFailed(
            f"round {server_round}: partition {v} dropped out and its mask key cannot be recovered: "
            f"{len(opened)} shares opened (from partitions {holders}), {node.threshold} needed"
            + (
                ", and no t of them give its public key (a holder sent a wrong share)"
                if len(opened) >= node.threshold
                else ""
            )
        )

    def round_bytes(self, metrics: dict[str, int | float]) -> dict[str, int | float]:
        """The round's byte counts with its queries added, and the queries' own (``secure-bytes-up/down``)."""
        return {
            "bytes-up": int(metrics["bytes-up"]) + self.bytes_up,
            "bytes-down": int(metrics["bytes-down"]) + self.bytes_down,
            "secure-bytes-up": self.bytes_up,
            "secure-bytes-down": self.bytes_down,
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
        """The keyed nodes' public keys and sealed shares, and the epochs (no secret: the server holds none)."""
        return {
            "epochs": dict(self.epochs),
            "keyed": {
                k: (n.epoch, n.mask_public, n.share_public, dict(n.sealed), n.threshold) for k, n in self.keyed.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`."""
        self.epochs = dict(state["epochs"])
        self.keyed = {
            k: KeyedNode(e, m, s, {h: tuple(v) for h, v in sealed.items()}, t)  # type: ignore[misc]
            for k, (e, m, s, sealed, t) in state["keyed"].items()
        }


def _key_bytes(value: object) -> bytes:
    """A 32-byte public key from an answer (ValueError otherwise)."""
    if not isinstance(value, bytes) or len(value) != 32:
        raise ValueError(f"a public key has 32 bytes, got {type(value).__name__}")
    return value


def need_of(nodes: dict[int, int], key: int) -> int:
    """The node id of partition ``key`` among ``nodes`` (node id → key), -1 if none."""
    return next((n for n, k in nodes.items() if k == key), -1)
