"""Secure aggregation, attacked: the honest-but-curious server of USER_GUIDE.md's threat model learns no client's signs.

The adversary (:class:`Adversary`) runs ``DistributedLion(secure=True)`` as written and keeps
everything it receives: every masked upload, also those it rejected and those that came after
their round closed, and every reveal of every round. For each upload it holds it then takes off
every mask it can compute from what it learned (a round's seeds are one-way: no round's reveals
give another's; under the old long-lived keys, one recovered key gave them all), and compares what is
left with the client's true signs (recorded inside the client, before masking). Each case is one
that opened whole sign vectors before issue 59: a dropout (the recovered key opened every earlier
round), a rejected reply and a late one (their senders' keys were recovered while the server held
their uploads), a round replayed after a resume (the same masks on other signs), and a round of
two survivors (each reads the other's signs from Δ).

"Nothing learned" is measured, not assumed: on the 281,034 coordinates of the default CNN, what
is left agrees with the true sign bit on a share within 6σ of 1/2 (σ = √(1/4d)), and equals the
true value in Z_{2^b} on a share within 6σ of 2⁻ᵇ: a coin's, not the 100 % of an unmasked upload.
A control in each case gives the adversary the one secret it lacks (taken from the client's own
state) and recovers every coordinate: the attack is right, the secret is what stops it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message

import flower_dlion.clients.dlion as client_module
from flower_dlion import DistributedLion
from flower_dlion.protocol import CLIENT_UPLOAD, METRICS, SECURE
from flower_dlion.secure import masking
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.model import Net

RUN = {"partitioner": "iid", "batch-size": 16}
D = sum(p.numel() for p in Net().parameters())  # 281,034


@dataclass
class Adversary:
    """The server's view, everything kept: uploads by (round, key), reveals by round, late replies withheld."""

    late: set[tuple[int, int]] = field(default_factory=set)  # (round, node id): reaches the server after the round
    dropped: set[tuple[int, int]] = field(default_factory=set)  # (round, node id): never reaches the server
    tamper: Callable[[int, Message], Message] | None = None  # what a faulty client changes (a rejected reply)
    session: int = 0  # which server run (a resumed one is the next): a replayed round's reveals are its own
    uploads: dict[tuple[int, int], list[tuple[int, bytes]]] = field(default_factory=dict)  # by (round, key)
    reveals: dict[tuple[int, int], list[tuple[int, bytes, dict[int, bytes]]]] = field(default_factory=dict)

    def hook(self, node_id: int, reply: Message) -> Message | None:
        """LocalGrid's reply hook: what the server receives, in time or late."""
        if reply.has_error():
            return reply
        kind, key = reply.metadata.message_type, node_id - 1000
        if kind == "train":
            t = int(reply.metadata.group_id)
            if (t, node_id) in self.dropped:
                return None
            self.uploads.setdefault((t, key), []).append(
                (self.session, bytes(reply.content[CLIENT_UPLOAD]["masked"].data))
            )
            if (t, node_id) in self.late:
                return None  # the server declared it dropped; it keeps the reply all the same
            return reply if self.tamper is None else self.tamper(node_id, reply)
        if SECURE in reply.content and "self" in reply.content[SECURE]:
            record = reply.content[SECURE]
            pairs = dict(zip(record["owners"], [bytes(s) for s in record["seeds"]], strict=True))
            self.reveals.setdefault((self.session, int(record["round"])), []).append(
                (key, bytes(record["self"]), pairs)
            )
        return reply

    def unmask(self, t: int, v: int, upload: tuple[int, bytes], extra: list[tuple[int, bytes]] = ()) -> np.ndarray:
        """v's round-t upload (session, planes) less every mask the server can compute, and ``extra`` (σ, seed) pairs.

        Values in Z_{2^b}.
        """
        session, planes = upload
        bits = len(planes) // masking.plane_bytes(D)
        acc = masking.sum_planes([np.frombuffer(planes, dtype=np.uint8)], D, bits)
        known = list(extra)
        for u, own, pairs in self.reveals.get(
            (session, t), []
        ):  # the round's reveals (no other round's seed gives this one's)
            if u == v:
                known.append((1, own))
            if v in pairs:
                known.append((1 if v < u else -1, pairs[v]))  # v added +M towards larger keys
        for sigma, seed in known:
            masking.add_planes_(acc, masking.mask_stream(seed, D, bits), subtract=sigma > 0)
        planes_out = masking.planes_bytes(acc, D)
        return sum(np.unpackbits(planes_out[j], count=D).astype(np.int64) << j for j in range(bits))


class Truth:
    """Each client's signs before masking, by (round, key), recorded inside the client."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.signs: dict[tuple[int, int], list[np.ndarray]] = {}
        real = client_module.mask_upload

        def spy(arrays: dict[str, Array], request, context, spec, server_round: int):
            bits = np.unpackbits(np.frombuffer(arrays["signs"].data, dtype=np.uint8), count=spec.d).astype(np.int64)
            out = real(arrays, request, context, spec, server_round)  # refusals raise before anything is kept
            self.signs.setdefault((server_round, int(request["me"])), []).append(bits)
            return out

        monkeypatch.setattr(client_module, "mask_upload", spy)


def learned(residual: np.ndarray, truth: np.ndarray, bits: int) -> tuple[float, float]:
    """(share of sign bits the residual gives right, share of values it gives exactly)."""
    return float(((residual & 1) == truth).mean()), float((residual == truth).mean())


def assert_nothing_learned(residual: np.ndarray, truth: np.ndarray, bits: int) -> None:
    sign, exact = learned(residual, truth, bits)
    p = 2.0**-bits
    assert abs(sign - 0.5) < 6 * math.sqrt(0.25 / D), f"sign bits right: {sign}"
    assert abs(exact - p) < 6 * math.sqrt(p * (1 - p) / D), f"values exact: {exact} (chance {p})"


def own_secrets(grid: LocalGrid, t: int, v: int) -> list[tuple[int, bytes]]:
    """What node v alone holds for round t (its self-mask seed, its round seeds): the control's missing piece."""
    record = grid.context(1000 + v).state["dlion.secure-keys"]
    pairs = zip(record[f"nbrs-{t}"], record[f"seeds-{t}"], strict=True)
    return [(1, bytes(record[f"self-{t}"]))] + [(1 if v < u else -1, bytes(s)) for u, s in pairs]


def federation(
    adversary: Adversary, n: int, key: str, **run: object
) -> tuple[LocalGrid, Callable[..., DistributedLion]]:
    """A grid of the repository's ClientApp whose replies pass the adversary, and a maker of secure strategies."""
    grid = LocalGrid(client_app, n, run_config={**RUN, **run}, reply_hook=adversary.hook)

    def strategy() -> DistributedLion:
        return DistributedLion(secure=True, min_train_nodes=3, min_available_nodes=n, state_key=key)

    return grid, strategy


def init() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(Net().state_dict())


def attack_all(adversary: Adversary, truth: Truth, grid: LocalGrid, *, control: bool = True) -> int:
    """Attack every upload held; with ``control``, recover the newest of them with the node's own secrets. The count."""
    for (t, v), uploads in adversary.uploads.items():
        for upload, signs in zip(uploads, truth.signs[(t, v)], strict=True):
            assert_nothing_learned(adversary.unmask(t, v, upload), signs, len(upload[1]) // masking.plane_bytes(D))
    if control:  # the newest round is still in the nodes' state (they keep 4)
        t, v = max(adversary.uploads)
        residual = Adversary().unmask(t, v, adversary.uploads[(t, v)][-1], own_secrets(grid, t, v))
        assert np.array_equal(residual, truth.signs[(t, v)][-1])
    return sum(len(u) for u in adversary.uploads.values())


# ---------------------------------------------------------------- the cases
def test_a_dropout_in_one_round_opens_no_other_round(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 5 nodes, 5 rounds; node 2 drops out of round 3 only, node 3 out of round 4 only
    truth, adversary = Truth(monkeypatch), Adversary(dropped={(3, 1002), (4, 1003)})
    grid, strategy = federation(adversary, 5, "drop")
    # Execute
    run = strategy()
    run.start(grid, init(), num_rounds=5, timeout=5)
    # Assert: every round applied; the survivors of rounds 3 and 4 revealed their seeds with the dropped
    # node, and no upload of any round, theirs or the dropped nodes', gives its signs away
    assert [h["applied"] for h in run.history] == [1] * 5 and [h["num-replies"] for h in run.history] == [5, 5, 4, 4, 5]
    assert all(2 in pairs for _, _, pairs in adversary.reveals[(0, 3)]) and len(adversary.reveals[(0, 3)]) == 4
    assert attack_all(adversary, truth, grid) == 23


def test_a_rejected_reply_is_never_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: in round 2, node 1 reports an impossible coin-flip count and node 3's upload is one byte
    # short: both rejected, both held by the server
    def tamper(node_id: int, reply: Message) -> Message:
        if reply.metadata.group_id == "2" and node_id == 1001:
            reply.content[METRICS]["coin-flips"] = -1
        if reply.metadata.group_id == "2" and node_id == 1003:
            masked = reply.content[CLIENT_UPLOAD]["masked"]
            cut = Array(dtype=masked.dtype, shape=masked.shape, stype=masked.stype, data=masked.data[:-1])
            reply.content[CLIENT_UPLOAD] = ArrayRecord({"masked": cut})
        return reply

    truth, adversary = Truth(monkeypatch), Adversary(tamper=tamper)
    grid, strategy = federation(adversary, 5, "reject")
    # Execute
    run = strategy()
    run.start(grid, init(), num_rounds=2, timeout=5)
    # Assert: the round went on with the 3 others (the rejected nodes' pairwise masks revealed, their
    # self-masks never asked for); neither rejected upload, nor any other, gives its signs away
    assert run.history[1]["num-rejected"] == 2 and run.history[1]["applied"] == 1
    assert sorted(u for u, _, _ in adversary.reveals[(0, 2)]) == [0, 2, 4]
    assert all(set(pairs) == {1, 3} for _, _, pairs in adversary.reveals[(0, 2)])
    assert attack_all(adversary, truth, grid) == 10


def test_a_late_reply_is_never_unmasked(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: node 4's round-2 reply reaches the server after it closed the round (declared dropped)
    truth, adversary = Truth(monkeypatch), Adversary(late={(2, 1004)})
    grid, strategy = federation(adversary, 5, "late")
    # Execute
    run = strategy()
    run.start(grid, init(), num_rounds=2, timeout=5)
    # Assert: all 4 survivors revealed their round-2 seeds with node 4 (every pairwise mask of its
    # upload is known: what opened it before issue 59), and still its upload gives nothing away
    assert run.history[1]["applied"] == 1 and run.history[1]["num-replies"] == 4
    assert sorted(u for u, _, pairs in adversary.reveals[(0, 2)] if 4 in pairs) == [0, 1, 2, 3]
    assert attack_all(adversary, truth, grid, control=False) == 10
    late = adversary.uploads[(2, 4)][0]
    assert_nothing_learned(adversary.unmask(2, 4, late), truth.signs[(2, 4)][0], 3)
    # control: its self-mask seed (in its state only) is the one piece missing
    record = grid.context(1004).state["dlion.secure-keys"]
    residual = adversary.unmask(2, 4, late, [(1, bytes(record["self-2"]))])
    assert np.array_equal(residual, truth.signs[(2, 4)][0])


def test_a_round_replayed_after_a_resume_reuses_no_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 4 nodes; a run goes to round 3 after a checkpoint at round 2; then the server resumes
    # from that checkpoint and runs round 3 again
    truth, adversary = Truth(monkeypatch), Adversary()
    # the state in the contexts, which a resumed round does not start from: the replayed round's signs
    # differ (from state files it would repeat them exactly, and equal signs show nothing either way)
    grid, strategy = federation(adversary, 4, "replay", **{"state-in-context": True})
    first = strategy()
    first.start(grid, init(), num_rounds=2, timeout=5)
    checkpoint = first.state_dict()
    went_on, adversary.session = strategy(), 1
    went_on.load_state_dict(checkpoint)
    went_on.start(grid, init(), num_rounds=3, timeout=5, start_round=3)
    # Execute: the replay
    replay, adversary.session = strategy(), 2
    replay.load_state_dict(checkpoint)
    replay.start(grid, init(), num_rounds=3, timeout=5, start_round=3)
    # Assert: both round-3 runs applied, each under new keys
    assert went_on.history[-1]["applied"] == 1 and replay.history[-1]["applied"] == 1
    first_keys = {k: n.mask_public for k, n in first.secure_rounds.keyed.items()}
    for resumed in (went_on, replay):
        assert {k.epoch for k in resumed.secure_rounds.keyed.values()} == {1}
    assert all(len({first_keys[k], went_on.secure_rounds.keyed[k].mask_public,
                    replay.secure_rounds.keyed[k].mask_public}) == 3 for k in range(4))  # fmt: skip
    # every node's two round-3 uploads, and their difference with the self-masks off (which gave
    # x₃ − x₃' exactly when the masks repeated): nothing
    assert attack_all(adversary, truth, grid) == 16
    for v in range(4):
        (y1, y2), (s1, s2) = adversary.uploads[(3, v)], truth.signs[(3, v)]
        diff = (adversary.unmask(3, v, y1) - adversary.unmask(3, v, y2)) % 8
        moved = (diff == 1) | (diff == 7)  # where the old masks gave one sign +1 and the other −1
        guessed = (diff[moved] == 1).astype(np.int64)  # diff +1: x₃ = 1, x₃' = 0
        assert abs(float((guessed == s1[moved]).mean()) - 0.5) < 6 * math.sqrt(0.25 / moved.sum())
        assert moved.sum() > 0.2 * D  # chance: 2 of 8 values (reused masks: only where the signs differ)
        assert not np.array_equal(s1, s2)  # the signs did differ: reused masks would have shown where


def test_a_server_that_does_not_re_key_after_a_resume_gets_no_upload(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: as above, but the resumed server keeps the old keys (a server that skips the re-keying)
    truth, adversary = Truth(monkeypatch), Adversary()
    grid, strategy = federation(adversary, 4, "no-rekey")
    first = strategy()
    first.start(grid, init(), num_rounds=3, timeout=5)
    keyed = dict(first.secure_rounds.keyed)
    replay, adversary.session = strategy(), 1
    replay.load_state_dict(first.state_dict())
    replay.secure_rounds.keyed = keyed
    # Execute: round 3 again, under the keys that masked it
    replay.start(grid, init(), num_rounds=3, timeout=5, start_round=3)
    # Assert: every node refused to mask (an error reply naming the reuse), the round applied nothing,
    # the adversary holds one round-3 upload per node
    assert replay.history[-1]["applied"] == 0 and replay.history[-1]["num-replies"] == 0
    assert all(len(adversary.uploads[(3, v)]) == 1 for v in range(4))
    assert attack_all(adversary, truth, grid) == 12


def test_a_round_with_two_survivors_is_not_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: 4 nodes; nodes 2 and 3 drop out of round 2
    truth, adversary = Truth(monkeypatch), Adversary(dropped={(2, 1002), (2, 1003)})
    grid, strategy = federation(adversary, 4, "two")
    # Execute
    run = strategy()
    run.start(grid, init(), num_rounds=3, timeout=5)
    # Assert: round 2 failed before any reveal (x unchanged: each survivor would read the other's
    # signs from Δ); rounds 1 and 3 applied; no upload gives its signs away
    assert [h["applied"] for h in run.history] == [1, 0, 1] and (0, 2) not in adversary.reveals
    assert [h["version"] for h in run.history] == [1, 1, 2]
    assert attack_all(adversary, truth, grid) == 10
