"""Secure aggregation: the masks' arithmetic, the client's refusals, real federations (attacks: test_secure_attacks.py).

Prepare / Execute / Assert. The federations run the repository's ClientApp on the in-process grid
(every message and context serialized), secure and plain side by side: the same Δ, bit for bit,
with partial participation, dropouts after masking and a resume.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict

from flower_dlion import DistributedLion
from flower_dlion.clients.secure_client import answer_query, check_train, mask_upload
from flower_dlion.params import ModelSpec
from flower_dlion.protocol import SECURE, ClientStateError
from flower_dlion.secure import masking
from flower_dlion.testing import LocalGrid

from .. import reference

SPEC20 = ModelSpec.from_module(torch.nn.Linear(4, 4))  # 20 trainable values


def planes_of(values: list[int], bits: int) -> np.ndarray:
    """Hand-made (b, ⌈d/8⌉) planes of small values."""
    v = np.array(values, dtype=np.uint8)
    return np.stack([np.packbits((v >> j) & 1) for j in range(bits)])


def values_of(planes: np.ndarray, d: int) -> list[int]:
    return sum(np.unpackbits(planes[j], count=d).astype(np.int64) << j for j in range(planes.shape[0])).tolist()


# ---------------------------------------------------------------- the arithmetic
def test_mask_bits_hold_a_count_of_n_votes() -> None:
    assert [masking.mask_bits(n) for n in (1, 2, 3, 4, 7, 8, 10, 255, 256)] == [1, 2, 2, 3, 3, 4, 4, 8, 9]
    with pytest.raises(ValueError, match="1 to 65535 clients"):
        masking.mask_bits(0)


def test_bit_sliced_add_and_subtract_are_mod_2_to_the_b() -> None:
    # Prepare: two vectors of 2-bit values (hand-computed sums and differences mod 4)
    a, b = [1, 2, 3, 0, 1], [3, 3, 1, 2, 0]
    acc = masking.sum_planes([planes_of(a, 2)], 5, 2)
    # Execute
    masking.add_planes_(acc, planes_of(b, 2))
    added = values_of(masking.planes_bytes(acc, 5), 5)
    masking.add_planes_(acc, planes_of(b, 2), subtract=True)
    reference.subtract_planes_(acc, planes_of(b, 2))
    # Assert
    assert added == [0, 1, 0, 2, 1]
    assert values_of(masking.planes_bytes(acc, 5), 5) == [2, 3, 2, 2, 1]


@pytest.mark.parametrize(("n", "d", "degree"), [(3, 13, 0), (5, 64, 2), (10, 1001, 0), (10, 999, 4)])
def test_masked_uploads_sum_to_the_counts_and_the_graph_is_symmetric(n: int, d: int, degree: int) -> None:
    # Prepare: n clients' random signs and keys
    rng = np.random.default_rng(n)
    bits = rng.integers(0, 2, (n, d)).astype(np.uint8)
    keys = [X25519PrivateKey.generate() for _ in range(n)]
    publics = [k.public_key().public_bytes_raw() for k in keys]
    b = masking.mask_bits(n)
    # Execute: each masks with its neighbours, σ = +1 towards larger keys
    uploads, graph = [], {}
    for i in range(n):
        graph[i] = masking.neighbours(list(range(n)), i, degree, [7])
        masks = [(1 if i < j else -1, masking.round_mask(masking.pair_seed(keys[i], publics[j], "r"), 7, d, b))
                 for j in graph[i]]  # fmt: skip
        uploads.append(masking.masked_planes(np.packbits(bits[i]), d, b, masks))
    total = masking.planes_bytes(masking.sum_planes(uploads, d, b), d)
    # Assert: the counts of +1, exactly; every edge seen from both ends; the degree kept
    assert values_of(total, d) == bits.sum(axis=0).tolist()
    assert all(i in graph[j] for i in graph for j in graph[i])
    assert all(len(g) == (degree or n - 1) for g in graph.values())


def test_pair_seeds_agree_and_masks_change_every_round() -> None:
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    pa, pb = a.public_key().public_bytes_raw(), b.public_key().public_bytes_raw()
    seed = masking.pair_seed(a, pb, "run")
    assert seed == masking.pair_seed(b, pa, "run") and seed != masking.pair_seed(a, pb, "other-run")
    assert not np.array_equal(masking.round_mask(seed, 1, 100, 3), masking.round_mask(seed, 2, 100, 3))


def test_round_seeds_differ_by_round_and_pair_and_the_self_mask_needs_its_32_bytes() -> None:
    # Prepare: two nodes' pair secret
    a, b = X25519PrivateKey.generate(), X25519PrivateKey.generate()
    seed = masking.pair_seed(a, b.public_key().public_bytes_raw(), "run")
    # Execute: rounds 1 … 50's seeds
    rounds = [masking.round_seed(seed, t) for t in range(1, 51)]
    # Assert: 50 distinct 32-byte seeds; the round mask is the stream of that round's seed
    assert len(set(rounds)) == 50 and all(len(r) == masking.SEED_BYTES for r in rounds)
    assert np.array_equal(masking.round_mask(seed, 7, 100, 3), masking.mask_stream(rounds[6], 100, 3))
    with pytest.raises(ValueError, match="a mask seed has 32 bytes, got 31"):
        masking.mask_stream(bytes(31), 100, 3)


# ---------------------------------------------------------------- the client's checks
PEERS = [0, 1, 2, 3]


def _client(me: int, peers: list[int], server_round: int = 5) -> tuple[Context, list[X25519PrivateKey]]:
    """A node keyed for run "run" that masked ``server_round`` with ``peers`` (the others' keys made here)."""
    context = Context(run_id=1, node_id=100 + me, node_config={}, state=RecordDict(), run_config={})
    mine = answer_query(ConfigRecord({"state-key": "run", "step": "keys", "epoch": 0}), context)
    others = [X25519PrivateKey.generate() for _ in peers]
    publics = [
        mine["mask-public"] if p == me else k.public_key().public_bytes_raw()
        for p, k in zip(peers, others, strict=True)
    ]
    mask_upload({"signs": _signs()}, _mask_request(me, peers, publics), context, SPEC20, server_round)
    return context, others


def _signs() -> Array:
    return Array(dtype="bit", shape=(20,), stype="dlion.sign1", data=bytes(3))


def _mask_request(me: int, peers: list[int], publics: list[bytes], **change: object) -> ConfigRecord:
    request = {"state-key": "run", "epoch": 0, "me": me, "participants": peers, "mask-publics": publics,
               "bits": masking.mask_bits(len(peers)), "degree": 0} | change  # fmt: skip
    return ConfigRecord(request)


def _unmask(me: int, survivors: list[int], dropped: list[int], server_round: int = 5) -> ConfigRecord:
    return ConfigRecord({"state-key": "run", "step": "unmask", "round": server_round, "me": me,
                         "survivors": survivors, "dropped": dropped})  # fmt: skip


def test_a_survivor_reveals_its_self_mask_and_its_round_seeds_with_the_dropped_only() -> None:
    # Prepare: node 0 masked round 5 with nodes 1 … 3
    context, others = _client(0, PEERS)
    mine = X25519PrivateKey.from_private_bytes(bytes(context.state["dlion.secure-keys"]["mask"]))
    # Execute: node 3 dropped out
    answer = answer_query(_unmask(0, [0, 1, 2], [3]), context)
    again = answer_query(_unmask(0, [0, 1, 2], [3]), context)  # the same request again: the same answer
    # Assert: node 3's round-5 seed (what node 3 computes from its own key), its self-mask seed of round 5
    pair = masking.pair_seed(others[3], mine.public_key().public_bytes_raw(), "run")
    assert answer["owners"] == [3] and answer["seeds"] == [masking.round_seed(pair, 5)]
    assert answer["self"] == bytes(context.state["dlion.secure-keys"]["self-5"]) and len(answer["self"]) == 32
    assert dict(again) == dict(answer)


@pytest.mark.parametrize(
    ("survivors", "dropped", "reason"),
    [
        ([1, 2, 3], [0], "this node is named dropped: its self-mask stays secret"),
        ([0, 1, 2], [], r"the survivors and the dropped do not split its participants \[0, 1, 2, 3\]"),
        ([0, 1], [2, 3], "2 survivors; unmasking needs 3"),
    ],
)
def test_a_client_refuses_an_unmask_request_that_would_expose_a_node(
    survivors: list[int], dropped: list[int], reason: str
) -> None:
    context, _ = _client(0, PEERS)
    with pytest.raises(ClientStateError, match=f"node 100: secure aggregation: round 5: {reason}"):
        answer_query(_unmask(0, survivors, dropped), context)


def test_a_client_refuses_a_second_unmask_request_with_other_survivors_and_a_round_it_did_not_mask() -> None:
    # Prepare: a first request for round 5 (node 3 dropped) answered
    context, _ = _client(0, PEERS)
    answer_query(_unmask(0, [0, 1, 2], [3]), context)
    # Execute / Assert: the same round, node 2 now called dropped (its pairwise masks would come off
    # while the server may hold its self-mask): refused; a round this node did not mask: refused
    with pytest.raises(ClientStateError, match=r"round 5: asked again with other survivors \[0, 1, 3\]"):
        answer_query(_unmask(0, [0, 1, 3], [2]), context)
    with pytest.raises(ClientStateError, match="round 4: it did not upload in that round"):
        answer_query(_unmask(0, [0, 1, 2], [3], server_round=4), context)


def test_a_client_never_masks_one_round_twice_under_one_key() -> None:
    # Prepare: node 0 masked round 5
    context, others = _client(0, PEERS)
    mine = X25519PrivateKey.from_private_bytes(bytes(context.state["dlion.secure-keys"]["mask"]))
    publics = [mine.public_key().public_bytes_raw()] + [k.public_key().public_bytes_raw() for k in others[1:]]
    # Execute / Assert: round 5 again, or an earlier round: refused (a replay would reuse the masks)
    for server_round in (5, 3):
        with pytest.raises(ClientStateError, match=f"round {server_round}: it masked round 5 with this key already"):
            mask_upload({"signs": _signs()}, _mask_request(0, PEERS, publics), context, SPEC20, server_round)
    # round 6 goes on; after a new key (epoch 1), round 5 may be masked again: other masks
    first = mask_upload({"signs": _signs()}, _mask_request(0, PEERS, publics), context, SPEC20, 6)["masked"]
    new = answer_query(ConfigRecord({"state-key": "run", "step": "keys", "epoch": 1}), context)["mask-public"]
    again = mask_upload({"signs": _signs()}, _mask_request(0, PEERS, [new, *publics[1:]], epoch=1), context, SPEC20, 5)
    assert first.data != again["masked"].data


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"participants": [0, 1], "mask-publics": None}, "at least 3"),
        ({"epoch": 1}, "epoch 0, the server asks for 1"),
        ({"bits": 5}, "do not fit 4 participants"),
        ({"mask-publics": "other"}, "another public mask key for this node"),
        ({"state-key": "../x"}, "run key"),
    ],
)
def test_a_client_refuses_a_masking_request_it_cannot_trust(change: dict, reason: str) -> None:
    context, others = _client(0, PEERS)
    mine = X25519PrivateKey.from_private_bytes(bytes(context.state["dlion.secure-keys"]["mask"]))
    publics = [mine.public_key().public_bytes_raw()] + [k.public_key().public_bytes_raw() for k in others[1:]]
    if change.get("mask-publics", "") is None:
        change["mask-publics"] = publics[:2]
    if change.get("mask-publics") == "other":
        change["mask-publics"] = [X25519PrivateKey.generate().public_key().public_bytes_raw(), *publics[1:]]
    with pytest.raises(ClientStateError, match=reason):
        mask_upload({"signs": _signs()}, _mask_request(0, PEERS, publics, **change), context, SPEC20, 6)


def test_a_train_message_of_a_secure_run_without_its_secure_record_is_refused() -> None:
    # Prepare: a node keyed for run "run"; a fresh node
    keyed, _ = _client(0, PEERS)
    fresh = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    plain = RecordDict({})
    # Execute / Assert: the keyed node refuses plain signs in its run; a config saying secure is refused too
    with pytest.raises(ClientStateError, match="node 100: secure aggregation: round 6: the train message of a secure"):
        check_train(plain, False, "run", 6, keyed)
    with pytest.raises(ClientStateError, match=r"node 7: .* round 2: the train message of a secure run has no"):
        check_train(plain, True, "run", 2, fresh)
    check_train(plain, False, "other-run", 6, keyed)  # another run of the node's: plain
    check_train(RecordDict({SECURE: ConfigRecord()}), True, "run", 6, keyed)  # the record is there


def test_secure_arguments_that_cannot_work_fail_before_round_1() -> None:
    with pytest.raises(ValueError, match="upload='sign' and broadcast_bits=0"):
        DistributedLion(secure=True, min_train_nodes=3, upload="sum", local_steps=2)
    with pytest.raises(ValueError, match="min_train_nodes >= 3"):
        DistributedLion(secure=True, min_train_nodes=2)
    assert DistributedLion(secure=True).min_train_nodes == 3 and DistributedLion().min_train_nodes == 2
    with pytest.raises(ValueError, match="momentum_sync_every=5 would send"):
        DistributedLion(secure=True, min_train_nodes=3, momentum_sync_every=5)
    with pytest.raises(TypeError, match="secure_threshold"):  # no Shamir shares any more (issue 59)
        DistributedLion(secure=True, min_train_nodes=3, secure_threshold=0.5)


# ---------------------------------------------------------------- buffers (BatchNorm) under masks
def test_buffer_moments_pool_batchnorm_variance_by_the_law_of_total_variance() -> None:
    # Prepare: one BatchNorm of 2 channels; two clients: means (1, 0) and (3, 0), variances (1, 2) and (1, 4)
    from flower_dlion.bounds import buffer_moments, mean_buffers, moment_count

    spec = ModelSpec.from_module(torch.nn.BatchNorm1d(2))
    a = np.array([1, 0, 1, 2, 5], dtype=np.float32)  # running_mean, running_var, num_batches_tracked
    b = np.array([3, 0, 1, 4, 7], dtype=np.float32)
    # Execute: the mean of the two clients' moments, as the server unmasks it
    moments = (buffer_moments(spec, a) + buffer_moments(spec, b)) / 2
    out = mean_buffers(spec, moments)
    # Assert: μ = (2, 0); σ² = mean σ² + mean μ² − μ² = (1 + 5 − 4, 3 + 0 − 0) = (2, 3); the count rounded
    assert moment_count(spec) == 7 and buffer_moments(spec, a).tolist() == [1, 0, 1, 2, 5, 1, 0]
    assert out["running_mean"].tolist() == [2, 0] and out["running_var"].tolist() == [2, 3]
    assert out["num_batches_tracked"].tolist() == 6 and out["num_batches_tracked"].dtype == np.int64


def test_fixed_point_masks_cancel_and_give_the_mean() -> None:
    # Prepare: three clients' values, pairwise buffer masks in Z_{2^64}
    values = [np.array([0.5, -2.25, 1e5]), np.array([1.5, 0.25, -3.0]), np.array([-1.0, 1.0, 2.0])]
    seeds = {(i, j): bytes([i, j]) * 16 for i in range(3) for j in range(i + 1, 3)}
    masked = []
    for i, v in enumerate(values):
        fixed = masking.to_fixed(v)
        for (p, q), seed in seeds.items():
            if i in (p, q):
                mask = masking.buffer_mask(seed, 3)
                fixed = fixed + mask if i == p else fixed - mask
        masked.append(fixed)
    # Execute
    mean = masking.from_fixed_mean(sum(masked), 3)
    # Assert: the mean to the fixed point's step (2⁻²⁶), each masked value far from its own
    np.testing.assert_allclose(mean, np.mean(values, axis=0), atol=2**-25)
    assert not np.allclose(masking.from_fixed_mean(masked[0], 1), values[0])


def test_a_batchnorm_model_runs_secure_with_its_buffers_averaged_under_masks() -> None:
    # Prepare: the BatchNorm model of tests/byom.py on 4 nodes, buffers synced every round
    from .. import byom

    def run(secure: bool) -> DistributedLion:
        torch.manual_seed(0)
        strategy = DistributedLion(secure=secure, min_train_nodes=3, min_available_nodes=4, buffer_sync_every=1,
                                   state_key=f"bn{int(secure)}")  # fmt: skip
        strategy.start(LocalGrid(byom.app, 4), ArrayRecord(byom.ByomNet().state_dict()), num_rounds=2, timeout=5)
        return strategy

    plain, secure = run(False), run(True)
    # Assert: the same x (each client keeps its own buffers); the server's BatchNorm statistics the
    # clients' mean (plain: their median), close to each other and not the initial ones
    assert torch.equal(plain.x, secure.x)
    assert all(h["applied"] == 1 for h in secure.history)
    server, median = secure.arrays()["bn.running_mean"].numpy(), plain.arrays()["bn.running_mean"].numpy()
    assert not np.allclose(server, 0.0) and np.abs(server - median).max() < 0.5 * np.abs(median).max()
    assert (secure.arrays()["bn.running_var"].numpy() > 0).all()
