"""A client's side of secure aggregation: its key, its doubly masked upload, and what it reveals as a survivor.

The server (:mod:`flower_dlion.strategies.secure_rounds`) sends three kinds of ``dlion.secure``
records (``protocol.SECURE``); :class:`~flower_dlion.DLionClient` hands each to this module:

- in a query, ``step = "keys"``: make a new X25519 mask key (a new *epoch*), keep its private half
  in ``context.state`` (never in a message, never logged), answer the public half;
- in a train message (:func:`mask_upload`): the round's participants and their public mask keys;
  the node uploads its packed signs as ``b`` bit planes plus its pairwise masks with its
  neighbours and a **self-mask** drawn fresh for the round
  (:func:`flower_dlion.secure.masking.masked_planes`), instead of the signs. It refuses to mask a
  round it has masked before with the same key (the masks would repeat on other signs);
- in a query, ``step = "unmask"``: reveal, as a survivor of a round, its self-mask seed of that
  round and its round seeds with the neighbours that dropped out of it, **after the checks of**
  :func:`_check_unmask`: the node masked that round, the survivors and the dropped split the
  round's participants as this node saw them, this node is a survivor, at least
  :data:`MIN_SURVIVORS` survived, and the split is the one of any earlier request for the round.

What a node reveals is one round's alone (round seeds are one-way: :func:`masking.round_seed`),
and never both halves of one node's masks: a node's self-mask only by itself as a survivor, its
pairwise masks only by others who were told it dropped out. A train message of a run this node
holds keys for (or whose config says ``secure``) that lacks the ``dlion.secure`` record is refused:
the node never uploads plain signs in a secure run (:func:`check_train`).

Everything the server sends is checked before it is used; a refusal is a
:class:`~flower_dlion.protocol.ClientStateError` naming the node, the round and the problem.
"""

from __future__ import annotations

import os

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from flwr.app import Array, ConfigRecord, Context, RecordDict

from ..bounds import buffer_moments
from ..params import ModelSpec
from ..protocol import MASKED_STYPE, SECURE, STATE_KEY, ClientStateError
from ..secure import masking
from ..secure.masking import MIN_PARTICIPANTS, MIN_SURVIVORS, SEED_BYTES

__all__ = ["KEYS_RECORD", "answer_query", "check_train", "mask_upload"]

KEYS_RECORD = "dlion.secure-keys"  # context.state: this node's key and what it masked in its last rounds
_KEPT_ROUNDS = 4  # rounds whose seeds a node keeps (to answer their unmask request)


def _fail(context: Context, why: str) -> ClientStateError:
    return ClientStateError(f"node {context.node_id}: secure aggregation: {why}")


def _get(request: ConfigRecord, key: str, kind: type, context: Context) -> object:
    """``request[key]`` if it is a ``kind`` (a list: of ``kind``), else a refusal naming the key."""
    value = request.get(key)
    if isinstance(value, list):
        ok = all(isinstance(v, kind) and not isinstance(v, bool) for v in value)
    else:
        ok = isinstance(value, kind) and not isinstance(value, bool)
    if not ok:
        raise _fail(context, f"the server's '{key}' is {type(value).__name__}, expected {kind.__name__}")
    return value


def _int(request: ConfigRecord, key: str, context: Context) -> int:
    return int(_get(request, key, int, context))  # type: ignore[call-overload]


def _ints(request: ConfigRecord, key: str, context: Context) -> list[int]:
    return [int(v) for v in _get(request, key, int, context)]  # type: ignore[attr-defined]


def _stored(context: Context, run_key: str) -> ConfigRecord:
    """The node's secure record of ``run_key`` (key, epoch, rounds masked); refused when it has none."""
    record = context.state.get(KEYS_RECORD)
    if not isinstance(record, ConfigRecord) or record.get("run") != run_key:
        raise _fail(context, "it holds no keys for this run (a new or restarted node): the server must re-key it")
    return record


def _run_key(request: ConfigRecord, context: Context) -> str:
    run_key = _get(request, "state-key", str, context)
    if not STATE_KEY.fullmatch(str(run_key)):
        raise _fail(context, f"the run key {run_key!r} is not 1 to 64 of A-Z a-z 0-9 _ -")
    return str(run_key)


def holds_keys(context: Context, run_key: str) -> bool:
    """Whether this node holds secure keys for the run ``run_key`` (it then masks every upload of that run)."""
    record = context.state.get(KEYS_RECORD)
    return isinstance(record, ConfigRecord) and record.get("run") == run_key


def check_train(content: RecordDict, secure: bool, run_key: str, server_round: int, context: Context) -> None:
    """Refuse a train message that would make this node upload plain signs in a secure run.

    A run is secure for this node when its config says so (``secure``) or when the node holds keys
    for it (:func:`holds_keys`); such a message must carry the ``dlion.secure`` record.
    """
    if SECURE not in content and (secure or (run_key and holds_keys(context, run_key))):
        raise _fail(
            context,
            f"round {server_round}: the train message of a secure run has no '{SECURE}' record: "
            "refused (this node never uploads plain signs there)",
        )


def answer_query(request: ConfigRecord, context: Context) -> ConfigRecord:
    """The answer to a ``dlion.secure`` query: a new public key, or a survivor's reveals (see the module doc)."""
    step, run_key = request.get("step"), _run_key(request, context)
    if step == "keys":  # a new mask key: its rounds start afresh (no earlier round's masks can recur)
        epoch = _int(request, "epoch", context)
        key = X25519PrivateKey.generate()
        context.state[KEYS_RECORD] = ConfigRecord(
            {"run": run_key, "epoch": epoch, "mask": key.private_bytes_raw(), "last-round": 0}
        )
        return ConfigRecord({"epoch": epoch, "mask-public": key.public_key().public_bytes_raw()})
    if step == "unmask":
        return _unmask(request, run_key, context)
    raise _fail(context, f"unknown step {step!r} (keys or unmask)")


def mask_upload(
    arrays: dict[str, Array], request: ConfigRecord, context: Context, spec: ModelSpec, server_round: int
) -> dict[str, Array]:
    """The reply's arrays with the packed signs replaced by the masked planes (``"masked"``, b·⌈d/8⌉ bytes).

    The planes are the signs plus ``Σⱼ σⱼ·Mⱼ`` over the node's neighbours (each ``Mⱼ`` the
    keystream of the pair's round seed) plus the self-mask (the keystream of a seed drawn for this
    round). In a buffer round, the buffers too: their moments (:func:`flower_dlion.bounds.buffer_moments`)
    as fixed point in Z_{2^64} under the same seeds' streams (``"masked-buffers"``), for their mean.

    Raises
    ------
    ClientStateError
        A request it cannot trust (see the checks below), or a round it masked before with this key.

    """
    d = spec.d
    run_key = _run_key(request, context)
    epoch, me = _int(request, "epoch", context), _int(request, "me", context)
    peers = _ints(request, "participants", context)
    publics = list(_get(request, "mask-publics", bytes, context))  # type: ignore[call-overload]
    degree, bits = _int(request, "degree", context), _int(request, "bits", context)
    where = f"round {server_round}"
    if set(arrays) - {"buffers"} != {"signs"}:
        raise _fail(context, f"{where}: masking needs the sign upload (and buffers), not {sorted(arrays)}")
    if len(peers) != len(publics) or len(set(peers)) != len(peers) or me not in peers:
        raise _fail(context, f"{where}: the participants must be distinct, include this node, one public mask key each")
    if len(peers) < MIN_PARTICIPANTS:
        raise _fail(context, f"{where}: {len(peers)} participants: a masked round needs at least {MIN_PARTICIPANTS}")
    if bits != masking.mask_bits(len(peers)) or not 0 <= degree < len(peers):
        raise _fail(context, f"{where}: bits {bits} / degree {degree} do not fit {len(peers)} participants")
    record = _stored(context, run_key)
    if record.get("epoch") != epoch:
        raise _fail(context, f"{where}: it holds keys of epoch {record.get('epoch')}, the server asks for {epoch}")
    if server_round <= int(record["last-round"]):  # type: ignore[call-overload]
        raise _fail(
            context,
            f"{where}: it masked round {record['last-round']} with this key already; masking round {server_round} "
            "again would reuse its masks on other signs: refused (a resumed server must re-key its nodes)",
        )
    key = X25519PrivateKey.from_private_bytes(bytes(record["mask"]))  # type: ignore[arg-type]
    public_of = dict(zip(peers, publics, strict=True))
    if public_of[me] != key.public_key().public_bytes_raw():
        raise _fail(context, f"{where}: the server lists another public mask key for this node")
    moments = buffer_moments(spec, arrays["buffers"].numpy()) if "buffers" in arrays else None  # what is summed
    neighbours, seeds = masking.neighbours(peers, me, degree, [server_round]), []
    for peer in neighbours:
        try:
            seeds.append(masking.round_seed(masking.pair_seed(key, public_of[peer], run_key), server_round))
        except ValueError as err:
            raise _fail(context, f"{where}: node {peer}'s public mask key is not an X25519 key ({err})") from err
    own = os.urandom(SEED_BYTES)  # the self-mask: revealed by this node alone, as a survivor of this round
    signed = [(1 if me < peer else -1, seed) for peer, seed in zip(neighbours, seeds, strict=True)] + [(1, own)]
    masks = [(sigma, masking.mask_stream(seed, d, bits)) for sigma, seed in signed]
    planes = masking.masked_planes(np.frombuffer(arrays["signs"].data, dtype=np.uint8), d, bits, masks)
    out = {"masked": Array(dtype="level", shape=(d,), stype=MASKED_STYPE, data=planes.tobytes())}
    if moments is not None:
        fixed = masking.to_fixed(moments)
        for sigma, seed in signed:  # uint64 arithmetic wraps: mod 2⁶⁴
            mask = masking.buffer_mask(seed, fixed.size)
            fixed = fixed + mask if sigma > 0 else fixed - mask
        out["masked-buffers"] = Array(dtype="uint64", shape=(fixed.size,), stype=MASKED_STYPE, data=fixed.tobytes())
    _remember_round(record, server_round, me, peers, neighbours, seeds, own)
    context.state[KEYS_RECORD] = record
    return out


def _remember_round(
    record: ConfigRecord, server_round: int, me: int, peers: list[int], neighbours: list[int], seeds: list[bytes],
    own: bytes,
) -> None:  # fmt: skip
    """Keep what answering the round's unmask request needs, for the last :data:`_KEPT_ROUNDS` rounds."""
    record["last-round"] = server_round
    record[f"me-{server_round}"] = me
    record[f"peers-{server_round}"] = list(peers)
    record[f"nbrs-{server_round}"] = list(neighbours)
    record[f"seeds-{server_round}"] = list(seeds)
    record[f"self-{server_round}"] = own
    rounds = sorted(int(key[len("peers-") :]) for key in record if key.startswith("peers-"))
    for old in rounds[:-_KEPT_ROUNDS]:
        for name in ("me", "peers", "nbrs", "seeds", "self", "told"):
            if f"{name}-{old}" in record:
                del record[f"{name}-{old}"]


def _check_unmask(record: ConfigRecord, request: ConfigRecord, context: Context) -> tuple[int, set[int]]:
    """The round and the dropped nodes of an unmask request, after the checks in the module doc."""
    server_round = _int(request, "round", context)
    me = _int(request, "me", context)
    survivors, dropped = set(_ints(request, "survivors", context)), set(_ints(request, "dropped", context))
    where = f"round {server_round}"
    peers = record.get(f"peers-{server_round}")
    if peers is None:
        raise _fail(context, f"{where}: it did not upload in that round (or no longer keeps it): nothing to reveal")
    if me != record[f"me-{server_round}"]:
        raise _fail(context, f"{where}: the server calls this node {me}, it masked as {record[f'me-{server_round}']}")
    if survivors & dropped or survivors | dropped != set(peers):  # type: ignore[arg-type]
        raise _fail(context, f"{where}: the survivors and the dropped do not split its participants {sorted(peers)}")  # type: ignore[arg-type]
    if me not in survivors:
        raise _fail(context, f"{where}: this node is named dropped: its self-mask stays secret")
    if len(survivors) < MIN_SURVIVORS:
        raise _fail(
            context,
            f"{where}: {len(survivors)} survivors; unmasking needs {MIN_SURVIVORS} "
            "(with fewer, each would read the others' signs from Δ)",
        )
    told = record.get(f"told-{server_round}")
    if told is not None and set(told) != survivors:  # type: ignore[arg-type]
        raise _fail(context, f"{where}: asked again with other survivors {sorted(survivors)} (first: {told})")
    record[f"told-{server_round}"] = sorted(survivors)
    return server_round, dropped


def _unmask(request: ConfigRecord, run_key: str, context: Context) -> ConfigRecord:
    """A survivor's reveals for one round: its self-mask seed, its round seeds with its dropped neighbours."""
    record = _stored(context, run_key)
    server_round, dropped = _check_unmask(record, request, context)
    neighbours = list(record[f"nbrs-{server_round}"])  # type: ignore[call-overload]
    seeds = list(record[f"seeds-{server_round}"])  # type: ignore[call-overload]
    owners = [v for v in neighbours if v in dropped]
    context.state[KEYS_RECORD] = record
    return ConfigRecord(
        {
            "round": server_round,
            "self": bytes(record[f"self-{server_round}"]),  # type: ignore[arg-type]
            "owners": owners,
            "seeds": [bytes(s) for v, s in zip(neighbours, seeds, strict=True) if v in dropped],
        }
    )
