"""Secure aggregation with the repository app's clients (library side: tests/library/test_secure.py)."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ArrayRecord, Message

from flower_dlion import DistributedLion
from flower_dlion.protocol import CLIENT_UPLOAD, SECURE
from flower_dlion.secure import masking
from flower_dlion.testing import LocalGrid
from flower_dlion_app.client_app import app as client_app
from flower_dlion_app.model import Net

from ..library.test_secure import planes_of, values_of

RUN = {"partitioner": "iid", "batch-size": 16}


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
    [(10, set(), "vote"), (10, {1003}, "vote"), (10, {1001, 1004, 1008}, "vote"), (7, {1002}, "mean")],
    ids=["none", "10pct", "30pct", "mean"],
)
def test_a_secure_round_gives_the_plain_delta_bit_for_bit_with_dropouts_after_masking(
    n: int, drop: set[int], how: str
) -> None:
    # Execute: the same federation, plain and secure, the same nodes losing their replies every round
    plain, _, _ = _run(False, n, 3, drop=drop, key=f"plain{len(drop)}{how}", aggregation=how)
    secure, history, strategy = _run(True, n, 3, drop=drop, key=f"secure{len(drop)}{how}", aggregation=how)
    # Assert: the same x; every round applied with the survivors; one reveal round trip a round (and
    # the keys' in round 1); no node re-keyed (no key is ever revealed)
    assert secure == plain
    assert [h["num-replies"] for h in history] == [n - len(drop)] * 3 and all(h["applied"] for h in history)
    assert [h["secure-round-trips"] for h in history] == [2, 1, 1]
    assert set(strategy.secure_rounds.epochs.values()) == {0}


def test_the_secure_mode_the_readme_gives_for_non_iid_data_matches_the_plain_run() -> None:
    # Execute: FedSMU's mode (the mean of 1-bit signs of 4 local SGD steps), plain and secure
    kwargs = {"aggregation": "mean", "local_optimizer": "sgd", "local_steps": 4, "local_lr": 0.03, "lr": 0.003,
              "weight_decay": 0.1, "init_seed": 0}  # fmt: skip
    plain, _, _ = _run(False, 4, 2, key="smu-plain", **kwargs)
    secure, history, _ = _run(True, 4, 2, key="smu-secure", **kwargs)
    # Assert: the same x, every round applied
    assert secure == plain and [h["applied"] for h in history] == [1, 1]


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
    # Assert: the same x as the plain run; 4 of 6 sampled; every node sampled after the resume re-keyed
    # (epoch 1: rounds after the checkpoint may have been masked already under the old keys)
    assert hashlib.sha256(second.x.numpy().tobytes()).hexdigest() == plain
    assert [h["num-sampled"] for h in second.history] == [4, 4, 4, 4] == [h["num-sampled"] for h in plain_history]
    assert set(first.secure_rounds.epochs.values()) == {0}
    assert {second.secure_rounds.keyed[k].epoch for k in second.secure_rounds.keyed} == {1}


def test_a_masked_upload_is_uniform_and_a_malformed_one_is_a_dropout() -> None:
    # Prepare: keep node 1002's masked upload of round 1; cut node 1004's in round 2
    kept = {}

    def hook(node_id: int, reply: Message) -> Message:
        if reply.metadata.message_type != "train" or reply.has_error():
            return reply
        if node_id == 1002 and not kept:
            kept["planes"] = reply.content[CLIENT_UPLOAD]["masked"].data
        if node_id == 1004 and _round2(reply):
            masked = reply.content[CLIENT_UPLOAD]["masked"]
            cut = Array(dtype=masked.dtype, shape=masked.shape, stype=masked.stype, data=masked.data[:-1])
            reply.content[CLIENT_UPLOAD] = ArrayRecord({"masked": cut})
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


def test_a_survivor_with_malformed_reveals_fails_the_round_and_no_secret_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: 6 nodes, node 1002 drops out every round; node 1000 answers round 2's unmask query with
    # a short self-mask seed
    def hook(node_id: int, reply: Message) -> Message:
        if node_id == 1000 and SECURE in reply.content and reply.content[SECURE].get("round") == 2:
            reply.content[SECURE]["self"] = bytes(31)
        return reply

    caplog.set_level(logging.DEBUG)
    _, history, _ = _run(True, 6, 3, drop={1002}, key="w-secure", hook=hook)
    # Assert: round 2 failed (no update: the survivor cannot be called dropped), rounds 1 and 3 applied
    assert [h["applied"] for h in history] == [1, 0, 1]
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "partition 0's reveals are malformed" in text
    assert "round 2: survivors [0] did not reveal their masks of round 2" in text
    # no private key or seed of any node in any log line (as bytes' repr or hex)
    grid = _LAST_GRID[0]
    secrets = []
    for n in grid.node_ids:
        record = grid.context(n).state["dlion.secure-keys"]
        secrets += [bytes(v) for k, v in record.items() if k == "mask" or k.startswith("self-")]
        secrets += [bytes(s) for k, v in record.items() if k.startswith("seeds-") for s in v]
    assert len(secrets) > 6 * 3 and text
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
