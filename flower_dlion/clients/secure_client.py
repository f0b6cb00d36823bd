"""A client's side of secure aggregation: its keys, its masked upload, and the shares it opens for the server.

The server (:mod:`flower_dlion.strategies.secure_rounds`) sends three kinds of ``dlion.secure``
records (``protocol.SECURE``); :class:`~flower_dlion.DLionClient` hands each to this module:

- in a query, ``step = "keys"``: make a new epoch's mask key (and, the first time, the share key,
  which then stays: it opens the shares this node holds; :class:`~flower_dlion.secure.shares.NodeKeys`),
  keep them in ``context.state`` (never in a message, never logged), answer the public halves;
- in a query, ``step = "shares"``: seal the Shamir shares of the mask key for the holders named;
- in a train message (:func:`mask_upload`): the round's participants and their public mask keys;
  the node uploads its packed signs as ``b`` bit planes plus its pairwise masks
  (:func:`flower_dlion.secure.masking.masked_planes`) instead of the signs;
- in a query, ``step = "unmask"``: open the shares of nodes that dropped out of a round, **after
  the checks of** :func:`_check_unmask`: the node took part in that round and replied, the
  dropped and the survivors split the round's participants as this node saw them, at least
  :data:`MIN_SURVIVORS` survived, and the server asks for no node it named a survivor (in this or
  an earlier request for the round). A server that asks for the key of a node that replied would
  unmask that node's signs: it is refused.

Everything the server sends is checked before it is used; a refusal is a
:class:`~flower_dlion.protocol.ClientStateError` naming the node and the problem.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ConfigRecord, Context

from ..bounds import buffer_moments
from ..params import ModelSpec
from ..protocol import MASKED_STYPE, STATE_KEY, ClientStateError
from ..secure import masking
from ..secure.masking import MIN_PARTICIPANTS, MIN_SURVIVORS
from ..secure.shares import NodeKeys, open_share, seal_shares

__all__ = ["KEYS_RECORD", "answer_query", "mask_upload"]

KEYS_RECORD = "dlion.secure-keys"  # context.state: this node's keys and what it saw of its last rounds
_KEPT_ROUNDS = 4  # rounds whose participants (and unmask requests) a node remembers


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


def _stored(context: Context, run_key: str) -> ConfigRecord:
    """The node's secure record of ``run_key`` (keys, epoch, rounds seen); refused when it has none."""
    record = context.state.get(KEYS_RECORD)
    if not isinstance(record, ConfigRecord) or record.get("run") != run_key:
        raise _fail(context, "it holds no keys for this run (a new or restarted node): the server must re-key it")
    return record


def _keys(context: Context, run_key: str, epoch: int) -> tuple[NodeKeys, ConfigRecord]:
    """The node's keys of ``epoch`` and its record; refused when the epoch is not the one it holds."""
    record = _stored(context, run_key)
    if record.get("epoch") != epoch:
        raise _fail(context, f"it holds keys of epoch {record.get('epoch')}, the server asks for epoch {epoch}")
    return NodeKeys.from_bytes(bytes(record["mask"]), bytes(record["share"])), record


def _run_key(request: ConfigRecord, context: Context) -> str:
    run_key = _get(request, "state-key", str, context)
    if not STATE_KEY.fullmatch(str(run_key)):
        raise _fail(context, f"the run key {run_key!r} is not 1 to 64 of A-Z a-z 0-9 _ -")
    return str(run_key)


def answer_query(request: ConfigRecord, context: Context) -> ConfigRecord:
    """The answer to a ``dlion.secure`` query: new keys, sealed shares, or opened shares (see the module doc)."""
    step, run_key = request.get("step"), _run_key(request, context)
    if step == "keys":  # a new mask key; the share key stays (it opens the shares this node holds)
        epoch = int(_get(request, "epoch", int, context))  # type: ignore[call-overload]
        old = context.state.get(KEYS_RECORD)
        keys = NodeKeys.generate()
        if isinstance(old, ConfigRecord) and old.get("run") == run_key:
            keys = NodeKeys(keys.mask, NodeKeys.from_bytes(bytes(old["mask"]), bytes(old["share"])).share)
        mask, share = keys.private_bytes()
        context.state[KEYS_RECORD] = ConfigRecord({"run": run_key, "epoch": epoch, "mask": mask, "share": share})
        mask_public, share_public = keys.public_bytes()
        return ConfigRecord({"epoch": epoch, "mask-public": mask_public, "share-public": share_public})
    if step == "shares":
        return _seal(request, run_key, context)
    if step == "unmask":
        return _unmask(request, run_key, context)
    raise _fail(context, f"unknown step {step!r} (keys, shares or unmask)")


def _seal(request: ConfigRecord, run_key: str, context: Context) -> ConfigRecord:
    """Sealed shares of the mask key, one per holder named (holders' public share keys in the request)."""
    epoch, me = int(_get(request, "epoch", int, context)), int(_get(request, "me", int, context))  # type: ignore[call-overload]
    holders = list(_get(request, "holders", int, context))  # type: ignore[call-overload]
    publics = list(_get(request, "share-publics", bytes, context))  # type: ignore[call-overload]
    threshold = int(_get(request, "threshold", int, context))  # type: ignore[call-overload]
    if len(holders) != len(publics) or len(set(holders)) != len(holders) or me in holders:
        raise _fail(context, "the holders must be distinct other nodes, one public share key each")
    if not 2 <= threshold <= len(holders):
        raise _fail(context, f"threshold {threshold} is not in [2, {len(holders)}] (the holders)")
    keys, _ = _keys(context, run_key, epoch)
    try:
        sealed = seal_shares(keys, me, epoch, dict(zip(holders, publics, strict=True)), threshold, run_key)
    except ValueError as err:
        raise _fail(context, f"a holder's public share key is not an X25519 key ({err})") from err
    return ConfigRecord({"holders": list(sealed), "sealed": list(sealed.values())})


def mask_upload(
    arrays: dict[str, Array], request: ConfigRecord, context: Context, spec: ModelSpec, server_round: int
) -> dict[str, Array]:
    """The reply's arrays with the packed signs replaced by the masked planes (``"masked"``, b·⌈d/8⌉ bytes).

    In a buffer round, the buffers too: their moments (:func:`flower_dlion.bounds.buffer_moments`)
    as fixed point in Z_{2^64} under the same pairs' masks (``"masked-buffers"``), for their mean.
    """
    d = spec.d
    run_key = _run_key(request, context)
    epoch, me = int(_get(request, "epoch", int, context)), int(_get(request, "me", int, context))  # type: ignore[call-overload]
    peers = list(_get(request, "participants", int, context))  # type: ignore[call-overload]
    publics = list(_get(request, "mask-publics", bytes, context))  # type: ignore[call-overload]
    degree, bits = int(_get(request, "degree", int, context)), int(_get(request, "bits", int, context))  # type: ignore[call-overload]
    if set(arrays) - {"buffers"} != {"signs"}:
        raise _fail(context, f"masking needs the sign upload (and buffers), the round uploads {sorted(arrays)}")
    if len(peers) != len(publics) or len(set(peers)) != len(peers) or me not in peers:
        raise _fail(context, "the participants must be distinct, include this node, one public mask key each")
    if len(peers) < MIN_PARTICIPANTS:
        raise _fail(context, f"{len(peers)} participants: a masked round needs at least {MIN_PARTICIPANTS}")
    if bits != masking.mask_bits(len(peers)) or not 0 <= degree < len(peers):
        raise _fail(context, f"bits {bits} / degree {degree} do not fit {len(peers)} participants")
    keys, record = _keys(context, run_key, epoch)
    public_of = dict(zip(peers, publics, strict=True))
    if public_of[me] != keys.public_bytes()[0]:
        raise _fail(context, "the server lists another public mask key for this node")
    seeds = []
    for peer in masking.neighbours(peers, me, degree, [server_round]):
        try:
            seeds.append((1 if me < peer else -1, masking.pair_seed(keys.mask, public_of[peer], run_key)))
        except ValueError as err:
            raise _fail(context, f"node {peer}'s public mask key is not an X25519 key ({err})") from err
    masks = [(sigma, masking.round_mask(seed, server_round, d, bits)) for sigma, seed in seeds]
    planes = masking.masked_planes(np.frombuffer(arrays["signs"].data, dtype=np.uint8), d, bits, masks)
    out = {"masked": Array(dtype="level", shape=(d,), stype=MASKED_STYPE, data=planes.tobytes())}
    if "buffers" in arrays:
        fixed = masking.to_fixed(buffer_moments(spec, arrays["buffers"].numpy()))
        for sigma, seed in seeds:  # uint64 arithmetic wraps: mod 2⁶⁴
            mask = masking.buffer_mask(seed, server_round, fixed.size)
            fixed = fixed + mask if sigma > 0 else fixed - mask
        out["masked-buffers"] = Array(dtype="uint64", shape=(fixed.size,), stype=MASKED_STYPE, data=fixed.tobytes())
    _remember_round(record, server_round, peers)
    context.state[KEYS_RECORD] = record
    return out


def _remember_round(record: ConfigRecord, server_round: int, peers: list[int]) -> None:
    """Keep the round's participants (for :func:`_check_unmask`), for the last :data:`_KEPT_ROUNDS` rounds."""
    record[f"peers-{server_round}"] = list(peers)
    rounds = sorted(int(key[len("peers-") :]) for key in record if key.startswith("peers-"))
    for old in rounds[:-_KEPT_ROUNDS]:
        for key in (f"peers-{old}", f"told-{old}"):
            if key in record:
                del record[key]


def _check_unmask(record: ConfigRecord, request: ConfigRecord, me: int, context: Context) -> tuple[int, list[int]]:
    """The round and the dropped nodes of an unmask request, after the checks in the module doc."""
    server_round = int(_get(request, "round", int, context))  # type: ignore[call-overload]
    survivors = set(_get(request, "survivors", int, context))  # type: ignore[call-overload]
    dropped = set(_get(request, "dropped", int, context))  # type: ignore[call-overload]
    peers = record.get(f"peers-{server_round}")
    if peers is None:
        raise _fail(context, f"it did not upload in round {server_round}: nothing to unmask there")
    if survivors & dropped or survivors | dropped != set(peers) or me not in survivors:
        raise _fail(context, f"round {server_round}: the survivors and the dropped do not split its participants")
    if len(survivors) < MIN_SURVIVORS:
        raise _fail(context, f"round {server_round}: {len(survivors)} survivor(s); unmasking needs {MIN_SURVIVORS}")
    told = set(record.get(f"told-{server_round}", []))  # type: ignore[arg-type]
    if told and told != survivors:
        raise _fail(context, f"round {server_round}: asked again with other survivors {sorted(survivors)}")
    record[f"told-{server_round}"] = sorted(survivors)
    return server_round, sorted(dropped)


def _unmask(request: ConfigRecord, run_key: str, context: Context) -> ConfigRecord:
    """Open this node's shares of the dropped nodes' mask keys (checked by :func:`_check_unmask`)."""
    epoch, me = int(_get(request, "epoch", int, context)), int(_get(request, "me", int, context))  # type: ignore[call-overload]
    keys, record = _keys(context, run_key, epoch)
    _, dropped = _check_unmask(record, request, me, context)
    owners = list(_get(request, "owners", int, context))  # type: ignore[call-overload]
    epochs = list(_get(request, "epochs", int, context))  # type: ignore[call-overload]
    publics = list(_get(request, "share-publics", bytes, context))  # type: ignore[call-overload]
    sealed = list(_get(request, "sealed", bytes, context))  # type: ignore[call-overload]
    if not len(owners) == len(epochs) == len(publics) == len(sealed) or not set(owners) <= set(dropped):
        raise _fail(context, f"asked for the keys of {sorted(set(owners) - set(dropped))}, which did not drop out")
    opened = []
    for owner, owner_epoch, public, box in zip(owners, epochs, publics, sealed, strict=True):
        try:
            opened.append(open_share(keys, public, box, run_key, owner, owner_epoch, me))
        except ValueError as err:
            raise _fail(context, str(err)) from err
    context.state[KEYS_RECORD] = record
    return ConfigRecord({"owners": owners, "shares": opened})
