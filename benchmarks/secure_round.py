"""Secure aggregation against the plain vote: bytes, round time, dropouts, and the cost at 11 M parameters.

    .venv/bin/python benchmarks/secure_round.py federation [--nodes 10] [--rounds 6]
    .venv/bin/python benchmarks/secure_round.py parts [--d 11173962] [--nodes 10]

``federation``: the repository's ClientApp (the default CNN, Fashion-MNIST, iid) under
``DistributedLion`` on the in-process grid, every message serialized, plain and secure in the same
process with the same seeds, with 0, 10 % and 30 % of the nodes losing their train replies every
round (after masking). Prints per run: the final model's hash (secure equal to plain: the same
counts), the replies per round, the upload per reply in bits a parameter as measured from the
reply messages (``bytes-up`` less the queries', rounds after the first), the key and unmasking
queries' bytes (the whole run) and round trips per round (rounds after the first: the survivors'
reveals, every round), and the median time of the rounds after the first, with secure over plain
(one process runs every client one after the other: a round's time is the sum of its clients' and
the server's).

``parts``: what secure aggregation adds at d values (default: ResNet-18's 11,173,962) with n
clients, against the plain path's own steps, timed with ``time.perf_counter`` (median of 5):
a client's pack (``codec.pack_signs``) and its masking (n − 1 pairwise masks and its self-mask,
ChaCha20, added bit-sliced); the server's count of n plain payloads (``codec.aggregate_packed``)
against the sum of n masked uploads, their n self-masks off and ``counts_delta``; and, for one
dropped node, its masks with the n − 1 survivors off the sum.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import statistics
import time

import numpy as np
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Message

from flower_dlion import codec
from flower_dlion.secure import masking
from flower_dlion.strategies.server_delta import counts_delta
from flower_dlion.uploads import Shape


def federation(nodes: int, rounds: int) -> None:
    """Plain and secure runs of the repository app, with 0, 10 % and 30 % dropouts."""
    from flwr.app import ArrayRecord

    from flower_dlion import DistributedLion
    from flower_dlion.testing import LocalGrid
    from flower_dlion_app.client_app import app
    from flower_dlion_app.model import Net

    print("dropouts | mode   | x hash           | replies/round | bits/param up | queries kB | trips/round | s/round")
    plain_seconds = 0.0
    for lost in (0, round(0.1 * nodes), round(0.3 * nodes)):
        drop = set(range(1000 + 1, 1000 + 1 + lost))

        def hook(node_id: int, reply: Message, drop: set[int] = drop) -> Message | None:
            return None if reply.metadata.message_type == "train" and node_id in drop else reply

        for secure in (False, True):
            torch.manual_seed(0)
            initial = ArrayRecord(Net().state_dict())
            grid = LocalGrid(app, nodes, run_config={"partitioner": "iid"}, reply_hook=hook)
            strategy = DistributedLion(secure=secure, min_train_nodes=3, min_available_nodes=nodes,
                                       state_key=f"bench{lost}{int(secure)}")  # fmt: skip
            ends: list[float] = [time.perf_counter()]  # after each round (the first: before round 1)

            def stamp(_: int, ends: list[float] = ends) -> None:
                ends.append(time.perf_counter())

            strategy.start(grid, initial, num_rounds=rounds, timeout=5.0, on_round_end=stamp)
            later, d = strategy.history[1:], strategy.num_parameters
            replies = sum(r["num-replies"] for r in later)
            sent = sum(r["bytes-up"] - r.get("secure-bytes-up", 0) for r in later)
            queries = sum(r.get("secure-bytes-up", 0) + r.get("secure-bytes-down", 0) for r in strategy.history)
            trips = statistics.mean(r.get("secure-round-trips", 0) for r in later)
            seconds = statistics.median(b - a for a, b in itertools.pairwise(ends[1:]))  # rounds 2 …
            plain_seconds = plain_seconds if secure else seconds
            ratio = f" ({seconds / plain_seconds:.2f}×)" if secure else ""
            digest = hashlib.sha256(strategy.x.numpy().tobytes()).hexdigest()[:16]
            print(
                f"{lost:8d} | {'secure' if secure else 'plain':6s} | {digest} | {replies / len(later):13.1f} "
                f"| {8 * sent / replies / d:13.3f} | {queries / 1e3:10.1f} | {trips:11.1f} | {seconds:.3f}{ratio}"
            )


def _median(f, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def parts(d: int, nodes: int) -> None:
    """The secure steps against the plain ones at d values and n clients."""
    b = masking.mask_bits(nodes)
    rng = np.random.default_rng(0)
    keys = [X25519PrivateKey.generate() for _ in range(nodes)]
    publics = [k.public_key().public_bytes_raw() for k in keys]
    u = torch.from_numpy(rng.standard_normal(d).astype(np.float32))
    signs = [codec.pack_signs(torch.from_numpy(rng.standard_normal(d).astype(np.float32))).numpy() for _ in keys]

    own = [bytes([i]) * masking.SEED_BYTES for i in range(nodes)]  # each client's self-mask seed of the round

    def masks_of(i: int) -> list[tuple[int, np.ndarray]]:
        seeds = [(j, masking.pair_seed(keys[i], publics[j], "bench")) for j in range(nodes) if j != i]
        pairs = [(1 if i < j else -1, masking.round_mask(s, 1, d, b)) for j, s in seeds]
        return [*pairs, (1, masking.mask_stream(own[i], d, b))]

    def unmask(survivors: range) -> np.ndarray:  # the survivors' sum, their self-masks off
        acc = masking.sum_planes([uploads[i] for i in survivors], d, b)
        for i in survivors:
            masking.add_planes_(acc, masking.mask_stream(own[i], d, b), subtract=True)
        return acc

    pack = _median(lambda: codec.pack_signs(u))
    mask = _median(lambda: masking.masked_planes(signs[0], d, b, masks_of(0)))
    uploads = [masking.masked_planes(signs[i], d, b, masks_of(i)) for i in range(nodes)]
    plain = _median(lambda: codec.aggregate_packed(signs, d, "vote"))
    shape = Shape(d, [d], 1)
    secure = _median(lambda: counts_delta(masking.planes_bytes(unmask(range(nodes)), d), nodes, shape, how="vote"))

    def recover_one() -> None:  # node 0 dropped: each survivor's mask with it off the sum (its revealed round seed)
        acc = unmask(range(1, nodes))
        for j in range(1, nodes):
            masking.add_planes_(acc, masking.round_mask(masking.pair_seed(keys[0], publics[j], "bench"), 1, d, b),
                                subtract=False)  # fmt: skip

    recover = _median(recover_one) - _median(lambda: unmask(range(1, nodes)))
    same = codec.aggregate_packed(signs, d, "vote").levels.equal(
        counts_delta(masking.planes_bytes(unmask(range(nodes)), d), nodes, shape, how="vote").levels
    )
    print(f"d = {d:,}, n = {nodes}, b = {b} bits a parameter (plain: 1)")
    print(f"client: pack signs {pack * 1e3:.1f} ms; masking ({nodes - 1} pairwise masks + its self-mask) "
          f"+{mask * 1e3:.1f} ms")  # fmt: skip
    print(f"server: plain vote of {nodes} {plain * 1e3:.1f} ms; secure sum + vote {secure * 1e3:.1f} ms "
          f"(same levels: {bool(same)}; {nodes} self-masks off included); one dropout's masks off "
          f"+{recover * 1e3:.1f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["federation", "parts"])
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--d", type=int, default=11_173_962)
    args = parser.parse_args()
    if args.what == "federation":
        federation(args.nodes, args.rounds)
    else:
        parts(args.d, args.nodes)


if __name__ == "__main__":
    main()
