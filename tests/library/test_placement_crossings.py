"""Issue 60 (GPU items, checked on the CPU): the bytes a D-Lion client moves between host and device.

``clients/placement.py`` is the one place a client's arrays cross between the host (numpy) and
its compute device (torch), and it counts the bytes that cross on a GPU in
``Placement.crossings``, on the CPU as well (there the crossings are views: the count is of what
would be copied). These tests run real client rounds of the default CNN (``Net``, d = 281,034)
through the public path (``DLionClient`` behind a ``LocalGrid``) and pin the bytes per in-sync
round for the first node at a version and for a second node at the same version:

================  ===============================  ==========================  ==================
direction         what                             first node at a version     second node
================  ===============================  ==========================  ==================
host → device     the packed Δ (``"delta"``)       ⌈d/5⌉ (trits; ⌈d/8⌉ signs)  0 (replica shared)
device → host     x for its CRC (``"x-crc"``)      4·d                         0 (cached on it)
device → host     the counts (``"counts"``)        4·d (anchored downlink)     0 (cached on it)
device → host     m persisted (``"m-persist"``)    4·d, or 2·d in bfloat16     the same
device → host     the upload (``protocol``)        ⌈d/8⌉ (packed signs)        the same
================  ===============================  ==========================  ==================

Issue 60 wants two of these cut: **x's CRC** (4·d to the host per version: a checksum on the
device would need only 4 bytes) and **m's persisted copy every message** (4·d, or 2·d, per node
per round: persisting it less often is a change to what a restarted node resumes from). Neither
can be cut in ``placement.py`` without changing a result bit: x's host copy is already made once
per replica and reused (the chain downlink persists it; a second node at that version pays
nothing, asserted below), and m changes every round. The numbers below show both, so that the
change that cuts one updates this table and its test.

The upload crosses in ``protocol.bits_array`` (outside ``Placement``): it is measured from the
reply. An extra crossing anywhere in ``Placement`` (an extra 4·d copy per round) fails the exact
per-label comparisons; one outside ``clients/placement.py`` fails
``test_client_state.test_only_placement_moves_arrays_between_host_and_device``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, Message
from flwr.clientapp import ClientApp

from flower_dlion import DistributedLion, DLionClient, codec
from flower_dlion.clients.placement import Crossings, Placement
from flower_dlion.clients.resident import Replica
from flower_dlion.protocol import CLIENT_UPLOAD, CONFIG
from flower_dlion.testing import LocalGrid

from ..models import Net

D = 281_034  # the default CNN's trainable values
CPU = torch.device("cpu")


@dataclass
class Sent:
    """What one node's train message moved: the crossings Placement counted, the upload, the message's kind."""

    node: int
    kind: str
    crossed: Crossings
    upload: int  # bytes of the packed signs in the reply


def federation(rounds: int, nodes: int = 2, downlink: str = "auto", **settings: object) -> list[Sent]:
    """``rounds`` rounds of ``nodes`` D-Lion clients of the default CNN in one process; each message's crossings."""
    app = ClientApp()
    client = DLionClient(app, Net, device="cpu", state_in_context=True, **settings)  # type: ignore[arg-type]
    seen: list[Sent] = []

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        for here in client._devices.values():
            here.placement.crossings.take()  # the hello's (the model) and anything before this message
        gen = torch.Generator().manual_seed(context.node_id)
        batches = [(torch.randn(8, 1, 28, 28, generator=gen), torch.randint(0, 10, (8,), generator=gen))]
        reply = client.train(msg, context, batches)
        (here,) = client._devices.values()
        upload = reply.content[CLIENT_UPLOAD]
        seen.append(
            Sent(
                context.node_id,
                str(msg.content[CONFIG]["kind"]),
                here.placement.crossings.take(),
                len(upload["signs"].data) if "signs" in upload else 0,
            )
        )
        return reply

    strategy = DistributedLion(lr=1e-3, downlink=downlink)  # type: ignore[arg-type]
    torch.manual_seed(0)
    strategy.start(LocalGrid(app, nodes), ArrayRecord(Net().state_dict()), num_rounds=rounds)
    assert strategy.num_parameters == D
    assert all(h["num-rejected"] == 0 and h["checksum-mismatches"] == 0 for h in strategy.history)
    return seen


def in_sync(seen: list[Sent], nodes: int) -> list[list[Sent]]:
    """The messages of the rounds after the first (every node at the server's version), grouped by round."""
    later = seen[nodes:]
    assert len(later) % nodes == 0
    return [later[i : i + nodes] for i in range(0, len(later), nodes)]


# ---------------------------------------------------------------- the in-sync round, as the default run makes it
@pytest.mark.parametrize(("momentum_dtype", "m_bytes"), [("float32", 4 * D), ("bfloat16", 2 * D)])
def test_an_in_sync_round_moves_the_packed_delta_down_and_x_counts_m_up(momentum_dtype: str, m_bytes: int) -> None:
    # Prepare / Execute: 2 nodes, 4 rounds, the anchored downlink (the default for a vote at a constant rate)
    seen = federation(4, momentum_dtype=momentum_dtype)
    trits, signs = codec.encoded_size(D, 3), codec.packed_size(D)
    assert (trits, signs) == ((D + 4) // 5, (D + 7) // 8) == (56_207, 35_130)
    rounds = in_sync(seen, 2)
    assert len(rounds) == 3
    for first, second in rounds:
        assert first.kind == second.kind == "counts"
        # Assert: the first node at a version: the packed Δ down; x (its CRC), the counts and m up
        assert first.crossed.to_device == {"delta": trits}
        assert first.crossed.to_host == {"x-crc": 4 * D, "counts": 4 * D, "m-persist": m_bytes}
        assert first.crossed.to_device_bytes == trits
        assert first.crossed.to_host_bytes == 8 * D + m_bytes
        # Assert: the second node at that version finds the replica made: nothing down, x's CRC and the
        # counts not again; only its own momentum
        assert second.crossed.to_device == {} and second.crossed.to_device_bytes == 0
        assert second.crossed.to_host == {"m-persist": m_bytes}
        assert second.crossed.to_host_bytes == m_bytes
        # Assert: each node's upload, ⌈d/8⌉ bytes (crosses in protocol.bits_array, not counted by Placement)
        assert first.upload == second.upload == signs


def test_the_chain_downlink_persists_the_copy_of_x_its_checksum_made() -> None:
    # Prepare / Execute: the chain downlink persists x itself, not an anchor and counts
    seen = federation(3, downlink="chain")
    for first, second in in_sync(seen, 2):
        assert first.kind == second.kind == "deltas"
        # Assert: x crosses once per version (its CRC), and that copy is the persisted x: no "x" label
        assert first.crossed.to_device == {"delta": codec.encoded_size(D, 3)}
        assert first.crossed.to_host == {"x-crc": 4 * D, "m-persist": 4 * D}
        assert second.crossed.to_device == {} and second.crossed.to_host == {"m-persist": 4 * D}


def test_a_node_not_kept_resident_loads_its_state_and_persists_no_array_it_loaded() -> None:
    # Prepare / Execute: no state kept on the device: every message starts from the persisted copy
    seen = federation(3, max_resident=0)
    for first, second in in_sync(seen, 2):
        # Assert: the first node finds its replica in the pool: only m is loaded
        assert first.crossed.to_device == {"load": 4 * D, "delta": codec.encoded_size(D, 3)}
        assert first.crossed.to_host == {"x-crc": 4 * D, "counts": 4 * D, "m-persist": 4 * D}
        # Assert: the second node finds both its replica (the pool keeps the two newest made) and the one the
        # first node made: only m is loaded, nothing is made again (issue 60: no x recomputed per load)
        assert second.crossed.to_device == {"load": 4 * D}
        assert second.crossed.to_host == {"m-persist": 4 * D}


# ---------------------------------------------------------------- the counters themselves
def test_placement_counts_what_would_cross_on_a_gpu_and_take_starts_again() -> None:
    # Prepare
    place = Placement(CPU)
    a = np.arange(6, dtype=np.float32)
    # Execute: to the device and back (views on the CPU), received bytes, bfloat16 m
    t = place.to_device(a)
    assert np.shares_memory(place.to_host(t, "m-persist"), a)  # no copy here, still counted
    place.bytes_to_device(b"\x01\x02\x03")
    place.to_host(torch.zeros(4, dtype=torch.bfloat16))
    taken = place.crossings.take()
    # Assert: counted by direction and purpose; take() returned them and zeroed the counters
    assert taken.to_device == {"array": 24, "delta": 3} and taken.to_device_bytes == 27
    assert taken.to_host == {"m-persist": 24, "array": 8} and taken.to_host_bytes == 32
    assert taken.count == 4
    assert place.crossings == Crossings()


def test_a_replica_crosses_to_the_host_once() -> None:
    # Prepare
    place = Placement(CPU)
    x = torch.linspace(-1, 1, 10)
    # Execute: a new replica (x for its CRC), then its x and counts asked for twice
    replica = Replica.of(x, 3, place)
    replica.counts = torch.zeros(10, dtype=torch.int32)
    for _ in range(2):
        replica.on_host("x", place)
        replica.on_host("counts", place)
    # Assert: x crossed once (for the CRC), the counts once
    assert isinstance(replica, Replica)
    assert place.crossings.take().to_host == {"x-crc": 40, "counts": 40}
