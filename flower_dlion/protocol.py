"""What a Distributed Lion message holds, shared by the strategy and the client.

Server → client (``train``)::

    "dlion.config"   ConfigRecord  server-round, kind ("full" | "counts" | "deltas" | "none"),
                                   base-version, version, num-levels[], lr[], weight-decay[],
                                   [scales[] (per Δ, one float per tensor)], beta1, beta2,
                                   seed (the strategy's: coin flips, batch order), layout,
                                   local-steps, accumulate, upload,
                                   [local-lr, local-weight-decay], [init-seed, init-checksum],
                                   [momentum-sync, momentum-sync-layers], [buffers]
    "dlion.update"   ArrayRecord   (``SERVER_UPDATE``) one Array "payload": the full x (float32) for kind "full",
                                   the encoded Δs back to back (stype "dlion.levels") for "deltas"
    "dlion.momentum" ArrayRecord   (after a momentum-sync round) Array "m": the combined (median)
                                   momentum of the synchronized layers, float32

The anchored downlink (``downlink.py``; a vote with exact broadcast, the default) sends kind
"counts": config ``base-version``, ``anchor-every`` and one entry per segment in
``segment-end`` / ``-decay`` / ``-step`` / ``-refresh`` / ``-context`` / ``-bytes`` (and
``segment-levels`` when a segment is one Δ sent as its packed levels, 2 or 3; 0 for the others), and in
"dlion.update" Array "counts" (stype "dlion.coded"): the segments back to back, each the
entropy-coded count differences (``entropy.py``: header, ANS words, CRC-32) or one Δ's packed
levels. Its "full" message holds
the anchor x_a (Array "payload", float32) at ``anchor-version`` and the segments since it. A
reply may carry ``context`` (a version): the client holds the two last Δs of that version, so the
next Δ can be coded with them as context.

A new node of a run with ``init = "seed"`` gets "init-seed" and "init-checksum" instead of
the full model, builds x₀ itself (its ``model_fn()`` under ``torch.manual_seed(seed)``), and
applies the Δs since version 0.
A Δ's value is ``scale · (2k − (L−1)) / (L−1)`` for level k of L (scale 1 when absent).

A ``query.dlion`` message (every strategy of ours, once per new node id) asks a node who it is::

    server → client  "hello"  ConfigRecord  state-key, state-round
    client → server  "hello"  ConfigRecord  partition-id (-1: none in the node config; the node
                                            is then known by its node id), version (of the
                                            replica the node would start from, -1: none),
                                            model (bytes: the model's state_dict entries with
                                            their kinds, ``params.ModelSpec.encode``)

A full model (kind "full") also carries the rest of the model when it has any::

    "dlion.rest"     ArrayRecord   the buffers, by state_dict name (frozen parameters: by reference)

In a buffer round (``buffers`` = 1 in the config) a reply also holds Array "buffers" in
"dlion.delta": the client's buffers, float32, flat, in the model description's order.
The ``train_config`` a ServerApp passes to ``start`` reaches the client as Flower's own
"config" ConfigRecord, as FedAvg sends it.

Client → server::

    "dlion.delta"    ArrayRecord   (``CLIENT_UPLOAD``) upload "sign" / "ef-sign": Array "signs", dtype "bit",
                                   shape (d,), stype "dlion.sign1", ⌈d/8⌉ bytes;
                                   upload "sum": Array "levels", dtype "level", shape (d,),
                                   stype "dlion.levels", the 2K+1 levels of U + K;
                                   "ef-sign": also Array "scales", float32, one per tensor;
                                   a momentum-sync round: also Array "momentum", float32
    "dlion.metrics"  MetricRecord  num-examples, train-loss, version, checksum, [coin-flips]
    "dlion.notice"   ConfigRecord  (``NOTICE``, optional) the node could not write its state since its last
                                   reply (:class:`WriteFailure`): node, partition-id, path, errno, error,
                                   round (whose state); an error reply says the same in its reason
                                   (``WriteFailure.text``). A server before it refuses such a reply
                                   (its records), as it refuses any record it does not know

Train and query messages carry ``state-key``, the run's identity (1 to 64 of ``A-Z a-z 0-9 _ -``:
the strategy's ``state_key``, else a random key of its own; kept across a resume): a client
keeps its state under it, so that two runs never share one, even with the same run id. A hello
carries ``state-round`` (start from your state as of the end of this round). With a
``state_key`` (state files that outlive the run) train messages also carry ``state-round`` (the
previous round, or the checkpoint's round after a resume) and ``keep-round`` (the server's
latest checkpoint: keep the state of that round on disk).

Versions count the Δs applied to x since the start. ``checksum`` is the CRC-32 of the
client's replica (float32 bytes) at ``version``, the point where it computed δ.

Other strategies (an app's own baselines: SCAFFOLD, gradient averaging) keep their messages to themselves.
"""

from __future__ import annotations

import functools
import io
import math
import re
import weakref
from collections.abc import Container, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute

from .params import state_checksum

__all__ = [
    "CLIENT_STATE_ERROR",
    "CLIENT_UPLOAD",
    "CODED_STYPE",
    "CONFIG",
    "EXPLAINED_FLIPS",
    "HELLO",
    "HELLO_ACTION",
    "LEVELS_STYPE",
    "MASKED_STYPE",
    "METRICS",
    "MOMENTUM",
    "NOTICE",
    "OPTIONAL_REPLY_METRICS",
    "OTHER_APP",
    "REST",
    "SECURE",
    "SEED_MISMATCH",
    "SERVER_UPDATE",
    "SIGN_STYPE",
    "STATE_KEY",
    "USER_CONFIG",
    "ClientStateError",
    "RejectedReply",
    "WriteFailure",
    "bits_array",
    "check_envelope",
    "checksum",
    "error_text",
    "float_array",
    "message_bytes",
    "npy_bytes",
    "read_metrics",
    "read_notice",
    "read_upload",
    "sync_prefixes",
    "to_array",
]

CONFIG = "dlion.config"
SERVER_UPDATE = "dlion.update"  # server → client: Δ, the broadcast update (or the full model); wire name kept
CLIENT_UPLOAD = "dlion.delta"  # client → server: δ, the client's packed signs; wire name kept
METRICS = "dlion.metrics"
NOTICE = "dlion.notice"  # client → server, optional in a reply: a state write that failed (WriteFailure)
MOMENTUM = "dlion.momentum"
HELLO = "hello"
HELLO_ACTION = "dlion"  # the hello is a "query.dlion" message: a user's own query handler stays free
REST = "dlion.rest"
USER_CONFIG = "config"  # the ServerApp's train_config, where Flower's FedAvg puts it
CLIENT_STATE_ERROR = "ClientStateError"  # in a client's error reason when its replica cannot serve a message
SEED_MISMATCH = "x0 built from seed"  # in a client's error when its x₀ differs from the server's
SIGN_STYPE = "dlion.sign1"
LEVELS_STYPE = "dlion.levels"
CODED_STYPE = "dlion.coded"  # entropy-coded count segments (flower_dlion.entropy), back to back
OTHER_APP = (  # what a node that runs another app's code most likely means (error texts on both sides)
    "a local SuperLink left running by an earlier `flwr run` (from another directory or Python "
    "environment) serves this run with that environment's packages, or an editable install of another "
    "app with the same package name shadows this app's files. Stop your own SuperLink (its command line "
    'holds your FLWR_HOME: pkill -f "$FLWR_HOME/local-superlink"), or give each app its own FLWR_HOME '
    "and ports (FLWR_LOCAL_SUPERLINK_HTTP_API_PORT, FLWR_LOCAL_CONTROL_API_PORT), as scripts/run.sh does"
)
MASKED_STYPE = "dlion.masked"  # secure aggregation: b bit planes of the signs plus pairwise masks (flower_dlion.secure)
SECURE = "dlion.secure"  # secure aggregation's records: the round's peers (train), setup and unmask queries
REPLY_METRICS = ("num-examples", "train-loss", "version", "checksum")
# coin-flips: signs sent as coin flips (exact zeros of the Lion mix); context: the version whose two last Δs
# the client holds (the next Δ can be coded with them), a short key: it rides on every reply
EXPLAINED_FLIPS = ("coin-flips-tensor", "coin-flips-share", "coin-flips-cause")  # flower_dlion.coin_flips
OPTIONAL_REPLY_METRICS = ("coin-flips", "context", *EXPLAINED_FLIPS)
STATE_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a run's key names its clients' state folder: no separators, no ".."


class ClientStateError(RuntimeError):
    """The node's stored state or configuration cannot serve the message it received (the server resyncs it)."""


class RejectedReply(ValueError):
    """A client reply that cannot be used; the message says why.

    ``resync=True``: the reply shows that the node's replica differs from the server's
    (version or checksum), so the node is sent the full model next time. ``final=True`` (a
    hello): the node cannot take part (its model differs), so it is not asked again.
    """

    def __init__(self, message: str, *, resync: bool = False, final: bool = False) -> None:
        super().__init__(message)
        self.resync = resync
        self.final = final


def error_text(msg: Message) -> str:
    """An error reply in a log line: who reports it (a client, or the SuperLink for a lost node), code, reason."""
    who = "the SuperLink reports" if msg.metadata.src_node_id == SUPERLINK_NODE_ID else "client error"
    return f"{who} (code {msg.error.code}): {msg.error.reason[:2000]}"


def check_envelope(
    msg: Message, sent: Container[int], server_round: int, records: Sequence[str], optional: Sequence[str] = ()
) -> None:
    """Reject error replies, replies from nodes not asked, for another round, or with other records.

    ``records`` must all be there; of ``optional`` any may be, and nothing else.
    """
    if msg.has_error():
        raise RejectedReply(error_text(msg))
    if msg.metadata.src_node_id not in sent:
        raise RejectedReply("no train message was sent to this node this round")
    if msg.metadata.group_id != str(server_round):
        raise RejectedReply(f"reply for round {msg.metadata.group_id!r}, the open round is {server_round}")
    keys = set(msg.content.keys())
    if not set(records) <= keys or not keys <= set(records) | set(optional):
        also = f" (and any of {sorted(optional)})" if optional else ""
        raise RejectedReply(f"records {sorted(msg.content.keys())}, expected {sorted(records)}{also}")


_WRITE_FAILED = re.compile(
    r"node (-?\d+): could not write its state to (.+?): \[Errno (\d+)\] ([A-Za-z][\w /,.-]*[\w.])"
)


@dataclass(frozen=True)
class WriteFailure:
    """A node could not write its state (a full or read-only state folder): what it tells the server.

    In a reply's :data:`NOTICE` record (:meth:`to_record`), or in an error reply's reason
    (:meth:`text`, found again by :meth:`find`), in the node's first reply once it knows.

    Attributes
    ----------
    node_id : int
        The node.
    partition : int
        Its partition id (-1: none in its node config).
    path : str
        The file (or folder) it could not write.
    errno : int
        The OS error's number (28: ENOSPC, 30: EROFS, 13: EACCES, 122: EDQUOT; 0: none given).
    error : str
        The OS error's text, e.g. "No space left on device".
    round : int
        The round whose state it was (-1: not known, from an error reply's reason).

    """

    node_id: int
    partition: int
    path: str
    errno: int
    error: str
    round: int = -1

    def text(self) -> str:
        """``node 1001: could not write its state to /x/slot-1.state: [Errno 28] No space left on device``."""
        return f"node {self.node_id}: could not write its state to {self.path}: [Errno {self.errno}] {self.error}"

    def to_record(self) -> ConfigRecord:
        """The reply's :data:`NOTICE` record."""
        values = {"partition-id": self.partition, "path": self.path, "errno": self.errno, "error": self.error}
        return ConfigRecord({"state-write-failed": self.text(), **values, "round": self.round})

    @classmethod
    def from_record(cls, node_id: int, record: object) -> WriteFailure:
        """The failure a reply's :data:`NOTICE` record reports, or RejectedReply saying what is wrong with it."""
        if not isinstance(record, ConfigRecord):
            raise RejectedReply(f"'{NOTICE}' must be a ConfigRecord, got a {type(record).__name__}")
        want = {"state-write-failed": str, "partition-id": int, "path": str, "errno": int, "error": str, "round": int}
        if set(record.keys()) != set(want) or any(
            type(record[k]) is not kind or (kind is str and len(str(record[k])) > 4096) for k, kind in want.items()
        ):
            raise RejectedReply(f"'{NOTICE}' holds {_short(dict(record))}, expected {sorted(want)}")
        return cls(node_id, *(record[k] for k in ("partition-id", "path", "errno", "error", "round")))  # type: ignore[arg-type]

    @classmethod
    def find(cls, reason: str) -> WriteFailure | None:
        """The failure an error reply's reason says (:meth:`text`), None where it says none."""
        found = _WRITE_FAILED.search(reason)
        if found is None:
            return None
        node, path, number, error = found.groups()
        return cls(int(node), -1, path, int(number), error)


def read_metrics(
    content: RecordDict, name: str, keys: Sequence[str], *, optional: Sequence[str] = (), extra_ok: bool = False
) -> dict[str, float]:
    """The finite numbers ``keys`` (and those of ``optional`` present) of the MetricRecord ``name``.

    ``num-examples`` must be >= 1. Other keys are rejected unless ``extra_ok``.
    """
    metrics = content[name]
    if not isinstance(metrics, MetricRecord):
        raise RejectedReply(f"'{name}' must be a MetricRecord")
    missing = [k for k in keys if k not in metrics]
    if missing:
        raise RejectedReply(f"metrics missing {missing}")
    extra = sorted(set(metrics) - set(keys) - set(optional))
    if extra and not extra_ok:
        raise RejectedReply(f"unexpected metrics {extra[:5]}{' …' if len(extra) > 5 else ''}")
    values = {k: metrics[k] for k in (*keys, *(k for k in optional if k in metrics))}
    for k, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) >= 2**53:
            raise RejectedReply(f"metric {k!r} is {_short(v)}, expected a finite number below 2**53")
    if "num-examples" in values and (not isinstance(values["num-examples"], int) or values["num-examples"] < 1):
        raise RejectedReply(f"num-examples is {values['num-examples']!r}, expected an integer >= 1")
    return values


def _short(value: object) -> str:
    """A value for a log line, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@functools.lru_cache(maxsize=64)
def npy_bytes(shape: tuple[int, ...]) -> int:
    """Bytes of a float32 Flower ``Array`` of ``shape`` (numpy's .npy header plus the values)."""
    return len(Array(np.zeros(shape, dtype=np.float32)).data)


def float_array(arr: Array, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Decode a float32 Array of exactly ``shape`` and exact size, or raise RejectedReply."""
    if arr.stype != "numpy.ndarray" or arr.dtype != "float32" or tuple(arr.shape) != shape:
        got = f"{_short(arr.stype)} {_short(arr.dtype)} {tuple(arr.shape)}"
        raise RejectedReply(f"Array {name!r} is {got}, expected float32 {shape}")
    if len(arr.data) != npy_bytes(shape):
        raise RejectedReply(f"Array {name!r} has {len(arr.data)} bytes, expected {npy_bytes(shape)}")
    try:
        a = arr.numpy()
    except Exception as err:
        raise RejectedReply(f"Array {name!r} does not decode: {_short(err)}") from err
    if a.shape != shape or a.dtype != np.float32:
        raise RejectedReply(f"Array {name!r} decodes to {a.dtype} {a.shape}, expected float32 {shape}")
    return a


def to_array(a: np.ndarray) -> Array:
    """``flwr.app.Array(a)``, built with one copy of the values instead of several.

    The same bytes as Flower's own (``numpy.save`` into a growing buffer, then a copy out of
    it): numpy's version 1.0 .npy header, then the values in C order (a test compares them).
    """
    a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray turns 0-d into 1-d)
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(a))
    except ValueError:  # a header too long for version 1.0: Flower's way
        return Array(a)
    data = b"".join((header.getvalue(), memoryview(a.reshape(-1)).cast("B")))
    return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=data)


def bits_array(packed: torch.Tensor, count: int, stype: str, dtype: str = "bit") -> Array:
    """Wrap packed bytes (any device) as one flat Flower Array of ``count`` values."""
    data = packed.cpu().numpy().tobytes()  # the only device → host copy: the packed bits
    return Array(dtype=dtype, shape=(count,), stype=stype, data=data)


def sync_prefixes(layers: str) -> tuple[str, ...]:
    """Run config ``momentum-sync-layers`` ("features.0, classifier") as name prefixes; () = all."""
    return tuple(p.strip() for p in layers.split(",") if p.strip())


def checksum(x: torch.Tensor | np.ndarray) -> int:
    """CRC-32 of a float32 replica's bytes (equal replicas ⇔ equal bytes): ``params.state_checksum(x)``."""
    return state_checksum(x)


_SIZES: weakref.WeakKeyDictionary[Message, int] = weakref.WeakKeyDictionary()


def message_bytes(message: Message) -> int:
    """Bytes a message puts on the wire: its serialized objects as Flower 1.41+ sends them.

    Flower sends a message as a tree of content-addressed objects (message, record dict,
    records, arrays, array chunks), each deflated with a small header; this sums the
    deflated size of every distinct object in the tree. Measured once per message object
    (the strategy and the metering grid see the same objects; a sent message is not changed),
    each object's id computed once (as Flower does when it sends: a parent's id would
    otherwise hash its children's bytes again).
    """
    size = _SIZES.get(message)
    if size is None:
        with no_object_id_recompute():
            size = sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
        _SIZES[message] = size
    return size


def read_upload(content: RecordDict, expected: dict[str, tuple[str, str, int]], d: int) -> dict[str, torch.Tensor]:
    """Check a reply's :data:`CLIENT_UPLOAD` record, each array; return its float32 arrays, decoded.

    ``expected``: array name → (stype, dtype, bytes) of the arrays the record must hold, all
    of them and no other. A float32 array (scales, momenta, buffers) must have exactly its
    shape and size and finite values (scales: none negative); another, its stype and dtype,
    shape ``(d,)`` (uint64: one value per 8 bytes) and its bytes. A shape that fits another
    model is final (the node is left out of sampling).
    """
    record = content[CLIENT_UPLOAD]
    if not isinstance(record, ArrayRecord) or set(record.keys()) != set(expected):
        got = sorted(record.keys()) if isinstance(record, ArrayRecord) else type(record).__name__
        raise RejectedReply(f"'{CLIENT_UPLOAD}' must be an ArrayRecord holding {sorted(expected)}, got {got}")
    floats = {}
    for name, (stype, dtype, nbytes) in expected.items():
        arr = record[name]
        if not isinstance(arr, Array):
            raise RejectedReply(f"{name!r} is a {type(arr).__name__}, expected an Array")
        if dtype == "float32":
            if arr.dtype == "float32" and (got := tuple(arr.shape)) != (nbytes // 4,):  # another model's: final
                raise RejectedReply(f"Array {name!r} shape {got}, expected {(nbytes // 4,)}", final=True)
            a = torch.from_numpy(float_array(arr, (nbytes // 4,), name).copy())
            if not bool(torch.isfinite(a).all()) or (name == "scales" and bool((a < 0).any())):
                raise RejectedReply(f"Array {name!r} has non-finite{' or negative' if name == 'scales' else ''} values")
            floats[name] = a
            continue
        if arr.stype != stype or arr.dtype != dtype:
            raise RejectedReply(
                f"Array {name!r} has stype {arr.stype!r} dtype {arr.dtype!r}, expected {stype!r} {dtype!r}"
            )
        shape = (nbytes // 8,) if dtype == "uint64" else (d,)
        if tuple(arr.shape) != shape:  # the node's model has another layout
            raise RejectedReply(f"Array {name!r} shape {tuple(arr.shape)}, expected {shape}", final=True)
        if len(arr.data) != nbytes:
            raise RejectedReply(f"Array {name!r} has {len(arr.data)} bytes, expected {nbytes} for d={d}")
    return floats


def read_notice(msg: Message) -> WriteFailure | RejectedReply | None:
    """The failed state write a reply reports (read whatever the reply's check finds), None where it reports none.

    In an error reply's reason (:meth:`WriteFailure.find`), else in its :data:`NOTICE` record
    (:meth:`WriteFailure.from_record`, the sender's node id); a malformed record gives the
    RejectedReply that says what is wrong with it (the reply itself is judged on its own).
    """
    if msg.has_error():
        return WriteFailure.find(msg.error.reason)
    if NOTICE not in msg.content:
        return None
    try:
        return WriteFailure.from_record(msg.metadata.src_node_id, msg.content[NOTICE])
    except RejectedReply as err:
        return err
