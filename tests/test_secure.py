"""Secure aggregation: the masks' arithmetic, the keys' shares, the client's refusals, and real federations.

Prepare / Execute / Assert. The federations run the repository's ClientApp on the in-process grid
(every message and context serialized), secure and plain side by side: the same Δ, bit for bit,
with partial participation, dropouts after masking and a resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from flower_dlion import DistributedLion
from flower_dlion.clients.secure_client import answer_query, mask_upload
from flower_dlion.params import ModelSpec
from flower_dlion.protocol import SECURE, UPLOAD, ClientStateError
from flower_dlion.secure import masking
from flower_dlion.secure.shares import NodeKeys, open_share, recover_mask_key, seal_shares, threshold_for
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.local_grid import LocalGrid
from flower_dlion_app.model import Net

RUN = {"partitioner": "iid", "batch-size": 16}
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
    masking.subtract_planes_(acc, planes_of(b, 2))
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


# ---------------------------------------------------------------- the shares
def test_t_shares_recover_the_mask_key_and_fewer_or_foreign_ones_do_not() -> None:
    # Prepare: node 0's key shared among holders 1 … 5, t = 3
    keys = {k: NodeKeys.generate() for k in range(6)}
    holders = {k: keys[k].public_bytes()[1] for k in range(1, 6)}
    t = threshold_for(5, 0.5)
    sealed = seal_shares(keys[0], 0, 4, holders, t, "run")
    owner_share = keys[0].public_bytes()[1]
    # Execute
    opened = [open_share(keys[h], owner_share, sealed[h], "run", 0, 4, h) for h in (2, 4, 5)]
    recovered = recover_mask_key(opened, keys[0].public_bytes()[0], t)
    # Assert: the key; too few shares, another holder's box, another epoch or a flipped byte are refused
    assert t == 3 and recovered.private_bytes_raw() == keys[0].private_bytes()[0]
    with pytest.raises(ValueError, match="2 shares, 3 needed"):
        recover_mask_key(opened[:2], keys[0].public_bytes()[0], t)
    with pytest.raises(ValueError, match="does not open"):
        open_share(keys[3], owner_share, sealed[2], "run", 0, 4, 3)
    with pytest.raises(ValueError, match="does not open"):
        open_share(keys[2], owner_share, sealed[2], "run", 0, 5, 2)
    tampered = sealed[2][:20] + bytes([sealed[2][20] ^ 1]) + sealed[2][21:]
    with pytest.raises(ValueError, match="does not open"):
        open_share(keys[2], owner_share, tampered, "run", 0, 4, 2)
    with pytest.raises(ValueError, match="another key"):
        recover_mask_key(opened, keys[1].public_bytes()[0], t)


# ---------------------------------------------------------------- the client's checks
def _client(me: int, peers: list[int]) -> tuple[Context, list[bytes]]:
    """A node keyed for run "run" that masked round 5 with ``peers`` (the others' keys generated here)."""
    context = Context(run_id=1, node_id=100 + me, node_config={}, state=RecordDict(), run_config={})
    mine = answer_query(ConfigRecord({"state-key": "run", "step": "keys", "epoch": 0}), context)
    publics = [mine["mask-public"] if p == me else NodeKeys.generate().public_bytes()[0] for p in peers]
    request = ConfigRecord({"state-key": "run", "epoch": 0, "me": me, "participants": peers, "mask-publics": publics,
                            "bits": masking.mask_bits(len(peers)), "degree": 0})  # fmt: skip
    signs = Array(dtype="bit", shape=(20,), stype="dlion.sign1", data=bytes(3))
    mask_upload({"signs": signs}, request, context, SPEC20, 5)
    return context, publics


def _unmask(me: int, survivors: list[int], dropped: list[int], owners: list[int]) -> ConfigRecord:
    return ConfigRecord({"state-key": "run", "step": "unmask", "round": 5, "epoch": 0, "me": me,
                         "survivors": survivors, "dropped": dropped, "owners": owners,
                         "epochs": [0] * len(owners), "share-publics": [bytes(32)] * len(owners),
                         "sealed": [bytes(80)] * len(owners)})  # fmt: skip


def test_a_client_refuses_to_unmask_a_node_that_replied_or_a_lone_survivor() -> None:
    # Prepare: node 0 masked round 5 with nodes 1 … 3
    context, _ = _client(0, [0, 1, 2, 3])
    # Execute / Assert: asked for the key of node 1, named a survivor
    with pytest.raises(ClientStateError, match=r"asked for the keys of \[1\], which did not drop out"):
        answer_query(_unmask(0, [0, 1], [2, 3], [1]), context)
    # a split that is not the round's participants, or a round it did not mask
    with pytest.raises(ClientStateError, match="do not split its participants"):
        answer_query(_unmask(0, [0, 1], [2], [2]), context)
    # one survivor: the server would read node 0's signs from the sum
    context, _ = _client(0, [0, 1, 2, 3])
    with pytest.raises(ClientStateError, match="1 survivor"):
        answer_query(_unmask(0, [0], [1, 2, 3], [1]), context)


def test_a_client_refuses_a_second_unmask_request_with_other_survivors() -> None:
    # Prepare: a first request (its shares do not open: refused after the split was recorded)
    context, _ = _client(0, [0, 1, 2, 3])
    with pytest.raises(ClientStateError, match="does not open"):
        answer_query(_unmask(0, [0, 1, 2], [3], [3]), context)
    # Execute / Assert: the same round, node 2 now called dropped
    with pytest.raises(ClientStateError, match="asked again with other survivors"):
        answer_query(_unmask(0, [0, 1], [2, 3], [2, 3]), context)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"participants": [0, 1], "mask-publics": None}, "at least 3"),
        ({"epoch": 1}, "epoch 0, the server asks for epoch 1"),
        ({"bits": 5}, "do not fit 4 participants"),
        ({"mask-publics": "other"}, "another public mask key for this node"),
        ({"state-key": "../x"}, "run key"),
    ],
)
def test_a_client_refuses_a_masking_request_it_cannot_trust(change: dict, reason: str) -> None:
    context, publics = _client(0, [0, 1, 2, 3])
    request = {"state-key": "run", "epoch": 0, "me": 0, "participants": [0, 1, 2, 3], "mask-publics": publics,
               "bits": 3, "degree": 0} | change  # fmt: skip
    if request["mask-publics"] is None:
        request["mask-publics"] = publics[:2]
    if request["mask-publics"] == "other":
        request["mask-publics"] = [NodeKeys.generate().public_bytes()[0], *publics[1:]]
    signs = Array(dtype="bit", shape=(20,), stype="dlion.sign1", data=bytes(3))
    with pytest.raises(ClientStateError, match=reason):
        mask_upload({"signs": signs}, ConfigRecord(request), context, SPEC20, 6)


def test_secure_arguments_that_cannot_work_fail_before_round_1() -> None:
    with pytest.raises(ValueError, match="upload='sign' and broadcast_bits=0"):
        DistributedLion(secure=True, min_train_nodes=3, upload="sum", local_steps=2)
    with pytest.raises(ValueError, match="min_train_nodes >= 3"):
        DistributedLion(secure=True, min_train_nodes=2)
    assert DistributedLion(secure=True).min_train_nodes == 3 and DistributedLion().min_train_nodes == 2
    with pytest.raises(ValueError, match="momentum_sync_every=5 would send"):
        DistributedLion(secure=True, min_train_nodes=3, momentum_sync_every=5)
    with pytest.raises(ValueError, match=r"secure_threshold must be in \(0, 1\]"):
        DistributedLion(secure=True, min_train_nodes=3, secure_threshold=0.0)


# ---------------------------------------------------------------- real federations
def _run(secure: bool, n: int, rounds: int, *, drop: set[int] = frozenset(), key: str, hook=None, **kwargs):
    """x's hash and the history after ``rounds`` rounds; ``drop``: nodes whose train replies are lost."""
    torch.manual_seed(0)
    init = ArrayRecord(Net().state_dict())

    def reply_hook(node_id: int, reply: Message) -> Message | None:
        if reply.metadata.message_type == "train" and node_id in drop:
            return None
        return reply if hook is None else hook(node_id, reply)

    grid = LocalGrid(client_app, n, run_config=RUN, reply_hook=reply_hook)
    strategy = DistributedLion(secure=secure, min_train_nodes=3, min_available_nodes=n, state_key=key, **kwargs)
    strategy.start(grid, init, num_rounds=rounds, timeout=5)
    _LAST_GRID[:] = [grid]
    return hashlib.sha256(strategy.x.numpy().tobytes()).hexdigest(), strategy.history, strategy


_LAST_GRID: list[LocalGrid] = []  # the grid of the last _run (its nodes' contexts)


@pytest.mark.parametrize(
    ("n", "drop", "how"),
    [(10, {1003}, "vote"), (10, {1001, 1004, 1008}, "vote"), (7, {1002}, "mean")],
    ids=["10pct", "30pct", "mean"],
)
def test_a_secure_round_gives_the_plain_delta_bit_for_bit_with_dropouts_after_masking(
    n: int, drop: set[int], how: str
) -> None:
    # Execute: the same federation, plain and secure, the same nodes losing their replies every round
    plain, _, _ = _run(False, n, 3, drop=drop, key=f"plain{len(drop)}{how}", aggregation=how)
    secure, history, strategy = _run(True, n, 3, drop=drop, key=f"secure{len(drop)}{how}", aggregation=how)
    # Assert: the same x; every round applied with the survivors; each dropped node re-keyed each round
    assert secure == plain
    assert [h["num-replies"] for h in history] == [n - len(drop)] * 3 and all(h["applied"] for h in history)
    assert all(strategy.secure_rounds.epochs[k - 1000] == 2 for k in drop)


def test_secure_rounds_with_partial_participation_and_a_resume_match_the_plain_run() -> None:
    # Execute: 6 nodes, 4 sampled a round (the participants change); secure run resumed after round 2
    plain, plain_history, _ = _run(False, 6, 4, key="pp-plain", fraction_train=0.67)
    torch.manual_seed(0)
    init = ArrayRecord(Net().state_dict())
    grid = LocalGrid(client_app, 6, run_config=RUN)
    first = DistributedLion(secure=True, min_train_nodes=3, min_available_nodes=6, fraction_train=0.67, state_key="pp")
    first.start(grid, init, num_rounds=2, timeout=5)
    second = DistributedLion(secure=True, min_train_nodes=3, min_available_nodes=6, fraction_train=0.67, state_key="pp")
    second.load_state_dict(first.state_dict())
    second.start(grid, init, num_rounds=4, timeout=5, start_round=3)
    # Assert: the same x as the plain run; 4 of 6 sampled; no re-keying after the resume (keys kept)
    assert hashlib.sha256(second.x.numpy().tobytes()).hexdigest() == plain
    assert [h["num-sampled"] for h in second.history] == [4, 4, 4, 4] == [h["num-sampled"] for h in plain_history]
    assert set(second.secure_rounds.epochs.values()) == {0}


def test_a_masked_upload_is_uniform_and_a_malformed_one_is_a_dropout() -> None:
    # Prepare: keep node 1002's masked upload of round 1; cut node 1004's in round 2
    kept = {}

    def hook(node_id: int, reply: Message) -> Message:
        if reply.metadata.message_type != "train" or reply.has_error():
            return reply
        if node_id == 1002 and not kept:
            kept["planes"] = reply.content[UPLOAD]["masked"].data
        if node_id == 1004 and _round2(reply):
            masked = reply.content[UPLOAD]["masked"]
            cut = Array(dtype=masked.dtype, shape=masked.shape, stype=masked.stype, data=masked.data[:-1])
            reply.content[UPLOAD] = ArrayRecord({"masked": cut})
        return reply

    plain, _, _ = _run(
        False, 6, 2, drop=set(), key="u-plain", hook=lambda n, r: None if n == 1004 and _round2(r) else r
    )
    secure, history, _ = _run(True, 6, 2, key="u-secure", hook=hook)
    # Assert: the 8 values of 3 bits are equally frequent (chi-square, 7 degrees of freedom, p > 1e-6),
    # whereas the signs alone take 2 of them
    d = sum(p.numel() for p in Net().parameters())
    counts = np.bincount(values_of(np.frombuffer(kept["planes"], np.uint8).reshape(3, -1), d), minlength=8)
    chi2 = float(((counts - d / 8) ** 2 / (d / 8)).sum())
    assert chi2 < 42.0  # the 1 − 10⁻⁶ quantile of χ²(7) is 41.9
    # the cut upload was refused by name, its sender's masks taken off, and the round the plain one without it
    assert history[1]["num-rejected"] == 1 and history[1]["applied"] == 1
    assert secure == plain


def _round2(reply: Message) -> bool:
    return reply.metadata.message_type == "train" and reply.metadata.group_id == "2"


def test_one_client_adding_a_count_under_masking_moves_the_counts_by_that_amount() -> None:
    # Prepare: 4 clients' signs; client 3 adds 5 to every coordinate of its masked upload (it may: a
    # masked value hides its range)
    n, d, b = 4, 40, masking.mask_bits(4)
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2, (n, d)).astype(np.uint8)
    keys = [X25519PrivateKey.generate() for _ in range(n)]
    publics = [k.public_key().public_bytes_raw() for k in keys]
    uploads = []
    for i in range(n):
        masks = [(1 if i < j else -1, masking.round_mask(masking.pair_seed(keys[i], publics[j], "r"), 3, d, b))
                 for j in range(n) if j != i]  # fmt: skip
        uploads.append(masking.masked_planes(np.packbits(bits[i]), d, b, masks))
    bad = masking.sum_planes([uploads[3]], d, b)
    masking.add_planes_(bad, planes_of([5] * d, b))
    uploads[3] = masking.planes_bytes(bad, d)
    # Execute
    counts = values_of(masking.planes_bytes(masking.sum_planes(uploads, d, b), d), d)
    # Assert: every count moved by 5 mod 8 (what the server sees: counts up to 7 of 4 votes, undetectable
    # where they stay ≤ 4): one client sets the vote wherever it likes
    assert counts == ((bits.sum(axis=0) + 5) % 8).tolist()


def test_a_wrong_share_from_one_holder_is_outvoted_and_no_secret_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: 6 nodes, node 1002 drops out every round; node 1000 answers unmask queries with a wrong share
    def hook(node_id: int, reply: Message) -> Message:
        if node_id == 1000 and SECURE in reply.content and "shares" in reply.content[SECURE]:
            record = reply.content[SECURE]
            record["shares"] = [bytes(len(s)) for s in record["shares"]]  # well-formed, wrong
        return reply

    caplog.set_level(logging.DEBUG)
    plain, _, _ = _run(False, 6, 2, drop={1002}, key="w-plain")
    secure, history, _ = _run(True, 6, 2, drop={1002}, key="w-secure", hook=hook)
    # Assert: the key recovered from the honest holders' shares; the same x as the plain run
    assert secure == plain and [h["applied"] for h in history] == [1, 1]
    assert [h["secure-bytes-up"] > 0 for h in history] == [True, True]
    # no private key of any node in any log line (as bytes' repr or hex)
    text = "\n".join(r.getMessage() for r in caplog.records)
    grid = _LAST_GRID[0]
    secrets = [bytes(grid.context(n).state["dlion.secure-keys"][k]) for n in grid.node_ids for k in ("mask", "share")]
    assert len(secrets) == 12 and text
    assert not any(key.hex() in text or repr(key) in text for key in secrets)


def test_the_repository_app_runs_secure_from_its_run_config(tmp_path: Path) -> None:
    # Execute: run config secure = true through the app (4 nodes, 2 rounds)
    from flower_dlion_app.server_app import run_federation

    cfg = {"num-server-rounds": 2, "eval-every": 2, "secure": True, "min-train-nodes": 3,
           "results-dir": str(tmp_path)}  # fmt: skip
    grid = LocalGrid(client_app, 4, run_config=cfg)
    run_federation(grid, cfg, save_model=False)
    # Assert: each node's upload was masked planes (b = 3 bits for 4 nodes), every round applied
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["applied"] for r in rows[1:]] == [1, 1]
    context = grid.context(grid.node_ids[0])
    assert context.state["dlion.secure-keys"]["epoch"] == 0


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
                mask = masking.buffer_mask(seed, 4, 3)
                fixed = fixed + mask if i == p else fixed - mask
        masked.append(fixed)
    # Execute
    mean = masking.from_fixed_mean(sum(masked), 3)
    # Assert: the mean to the fixed point's step (2⁻²⁶), each masked value far from its own
    np.testing.assert_allclose(mean, np.mean(values, axis=0), atol=2**-25)
    assert not np.allclose(masking.from_fixed_mean(masked[0], 1), values[0])


def test_a_batchnorm_model_runs_secure_with_its_buffers_averaged_under_masks() -> None:
    # Prepare: the BatchNorm model of tests/byom.py on 4 nodes, buffers synced every round
    from . import byom

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
