"""The typed records of a round, used by both sides: the server's :class:`RoundConfig`, a node's :class:`ReplyMetrics`.

**RoundConfig.** A train message's ``dlion.config`` ConfigRecord (:mod:`.protocol`) carries the
server's optimizer constants and the round's options. The server writes it with
:meth:`RoundConfig.to_record`, which sends only the values that differ from their defaults (to
save bytes); a client reads it with :meth:`RoundConfig.parse`, the one place where those defaults
are supplied, and where every value is checked against its range **before it touches the
node's state**: a hostile or mistaken server (``beta2 = 5``, ``beta1 = NaN``, ``accumulate = -3``,
``local-steps = 10⁹``) gets a :class:`~.protocol.ClientStateError` naming the node, the key, the
value and what is allowed, and the node keeps its state. The local work of a round,
``local-steps × accumulate`` batches, is bounded by the client's own ``max_batches``
(``DLionClient(max_batches=...)``), so that no server can keep a client busy for ever.

The keys that describe the model update itself (``kind``, the Δs' ``lr``, ``weight-decay`` and
``num-levels``, ``scales``, ``segment-levels``, the anchor) are per node and checked where they
are applied (:mod:`.clients.replica`).

**ReplyMetrics.** A reply's ``dlion.metrics`` MetricRecord: the client writes it with
:meth:`ReplyMetrics.to_record`, the server reads it with :meth:`ReplyMetrics.from_record`
(every value a finite number, the integers integers, nothing else there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from .drift import DRIFT_KINDS, LIMIT
from .protocol import (
    CONFIG,
    EXPLAINED_FLIPS,
    METRICS,
    OPTIONAL_REPLY_METRICS,
    OTHER_APP,
    REPLY_METRICS,
    STATE_KEY,
    ClientStateError,
    RejectedReply,
    read_metrics,
)
from .stochastic import NOISE_KINDS, NOISE_LIMIT
from .uploads import UPLOADS

__all__ = ["ALWAYS", "MAX_BATCHES", "PROXIMAL_LIMIT", "SCALE_BLOCK_LIMIT", "ReplyMetrics", "RoundConfig", "hello_keys"]

MAX_BATCHES = 1000  # default limit on one round's local work (local-steps × accumulate batches)
PROXIMAL_LIMIT = 1e6  # a server asking for a larger local proximal weight is refused
SCALE_BLOCK_LIMIT = 1 << 31
INT_LIMIT = 1 << 62  # versions, rounds and seeds: anything beyond is no count of rounds
CRC_LIMIT = (1 << 32) - 1  # a CRC-32


@dataclass(frozen=True)
class RoundConfig:
    """What the server asks of a node this round (``protocol``'s train config; defaults where absent).

    Attributes
    ----------
    server_round : int
        The round, >= 1.
    version : int
        The version x is at after this message's update, >= 0.
    seed : int
        The run's sampling seed (the client's batch order and coin flips), >= 0.
    beta1, beta2 : float
        Lion's interpolation and momentum decay, each in [0, 1).
    local_steps, accumulate : int
        Local steps, and batches per step, each >= 1; their product is at most the
        client's ``max_batches``.
    local_optimizer : str
        "lion" or "sgd".
    local_lr, local_weight_decay : float
        The local steps' rate and decay: finite, >= 0, ``local_lr · local_weight_decay < 1``;
        "sgd" needs ``local_lr > 0``.
    local_proximal_mu : float
        In [0, :data:`PROXIMAL_LIMIT`].
    stale_momentum : str
        "keep", "decay" or "reset".
    drift_correction : str
        "off" or "scaffold" (:mod:`flower_dlion.drift`; needs "sgd" and the ef-sign upload).
    drift_limits : tuple of float
        Where the last round cut the ef-sign scales, per scale block (drift correction): each in
        [0, 1e6], at most 2**20 of them; () when absent.
    upload : str
        One of :data:`flower_dlion.uploads.UPLOADS`.
    scale_block : int
        In [0, 2**31].
    sign_noise, sign_noise_kind : float, str
        τ of the stochastic signs in [0, 100] (0: deterministic), "uniform" or "gaussian"
        (:mod:`flower_dlion.stochastic`).
    momentum_sync, buffers : bool
        Upload the momentum / the buffers this round.
    momentum_sync_layers : str
        Comma-separated layer prefixes whose momentum is synchronized.
    state_key : str
        The run's identity (a folder name: 1 to 64 of ``A-Z a-z 0-9 _ -``), "" when absent.
    state_round : int | None
        Start from the state as of the end of this round (-1: the newest), None: the round before.
    keep_round : int
        The server's latest checkpoint (0: none), >= 0.
    secure : bool
        A secure-aggregation run: the message must carry its ``dlion.secure`` record.
    checksum : int | None
        The CRC-32 of the server's x at ``version`` (``x-checksum``): the node's replica after
        this message must have it, or nothing is stored and the node asks for a resync
        (:mod:`.clients.replica`); None (absent): not checked.

    """

    server_round: int
    version: int
    beta1: float
    beta2: float
    seed: int = 0
    local_steps: int = 1
    accumulate: int = 1
    local_optimizer: str = "lion"
    local_lr: float = 0.0
    local_weight_decay: float = 0.0
    local_proximal_mu: float = 0.0
    stale_momentum: str = "keep"
    drift_correction: str = "off"
    drift_limits: tuple[float, ...] = ()
    upload: str = "sign"
    scale_block: int = 0
    sign_noise: float = 0.0
    sign_noise_kind: str = "uniform"
    momentum_sync: bool = False
    buffers: bool = False
    momentum_sync_layers: str = ""
    state_key: str = ""
    state_round: int | None = None
    keep_round: int = 0
    secure: bool = False
    checksum: int | None = None

    @classmethod
    def parse(cls, record: Mapping[str, Any], node_id: int, *, max_batches: int = MAX_BATCHES) -> RoundConfig:
        """The round's options from a train message's config, each checked (see the class doc).

        Raises
        ------
        ClientStateError
            Naming the node, the key, the value and what is allowed, for a missing required key
            (``server-round``, ``version``, ``beta1``, ``beta2``), a value of the wrong type or
            out of its range, or local work beyond ``max_batches``.

        """
        r = _Reader(record, node_id)
        cfg = cls(
            server_round=r.int("server-round", None, low=1),
            version=r.int("version", None, low=0),
            beta1=r.float("beta1", None, low=0.0, below=1.0),
            beta2=r.float("beta2", None, low=0.0, below=1.0),
            seed=r.int("seed", 0, low=0),
            local_steps=r.int("local-steps", 1, low=1),
            accumulate=r.int("accumulate", 1, low=1),
            local_optimizer=r.choice("local-optimizer", "lion", ("lion", "sgd")),
            local_lr=r.float("local-lr", 0.0, low=0.0),
            local_weight_decay=r.float("local-weight-decay", 0.0, low=0.0),
            local_proximal_mu=r.float("local-proximal-mu", 0.0, low=0.0, high=PROXIMAL_LIMIT),
            stale_momentum=r.choice("stale-momentum", "keep", ("keep", "decay", "reset")),
            drift_correction=r.choice("drift-correction", "off", DRIFT_KINDS),
            drift_limits=r.floats("drift-limits", high=LIMIT),
            upload=r.choice("upload", "sign", tuple(UPLOADS)),
            scale_block=r.int("scale-block", 0, low=0, high=SCALE_BLOCK_LIMIT),
            sign_noise=r.float("sign-noise", 0.0, low=0.0, high=NOISE_LIMIT),
            sign_noise_kind=r.choice("sign-noise-kind", "uniform", NOISE_KINDS),
            momentum_sync=r.flag("momentum-sync"),
            buffers=r.flag("buffers"),
            momentum_sync_layers=r.text("momentum-sync-layers", ""),
            state_key=r.state_key(),
            state_round=r.int("state-round", None, low=-1, optional=True),
            keep_round=r.int("keep-round", 0, low=0),
            secure=r.flag("secure"),
            checksum=r.int("x-checksum", None, low=0, high=CRC_LIMIT, optional=True),
        )
        cfg._check_together(node_id, max_batches)
        return cfg

    @classmethod
    def read(cls, content: RecordDict, node_id: int, *, max_batches: int = MAX_BATCHES) -> RoundConfig:
        """:meth:`parse` of a train message's ``dlion.config``; a message without one is not DistributedLion's.

        Raises
        ------
        ClientStateError
            No ``dlion.config`` (naming the records the message has, and what may send them), or
            what :meth:`parse` refuses.

        """
        if CONFIG not in content:
            raise ClientStateError(
                f"node {node_id}: a train message with records {sorted(content.keys())}, not DistributedLion's "
                f"'{CONFIG}': does the ServerApp start DistributedLion? If it does, {OTHER_APP}"
            )
        return cls.parse(content[CONFIG], node_id, max_batches=max_batches)

    def _check_together(self, node_id: int, max_batches: int) -> None:
        where = f"node {node_id}: the server's round {self.server_round} config"
        work = self.local_steps * self.accumulate
        if work > max_batches:
            raise ClientStateError(
                f"{where} asks for local-steps × accumulate = {self.local_steps} × {self.accumulate} = {work} batches, "
                f"more than this client's limit of {max_batches} (DLionClient(max_batches=...)): refused"
            )
        if self.local_lr * self.local_weight_decay >= 1.0:
            raise ClientStateError(
                f"{where} has local-lr × local-weight-decay = {self.local_lr} × {self.local_weight_decay} >= 1 "
                "(x would change sign every step; < 1 allowed): refused"
            )
        if self.local_optimizer == "sgd" and not self.local_lr > 0.0:
            raise ClientStateError(f"{where} has local-optimizer 'sgd' with local-lr {self.local_lr} (> 0 needed)")
        if self.drift_correction != "off" and (self.local_optimizer, self.upload) != ("sgd", "ef-sign"):
            raise ClientStateError(
                f"{where} has drift-correction {self.drift_correction!r} with local-optimizer "
                f"{self.local_optimizer!r} and upload {self.upload!r} ('sgd' and 'ef-sign' needed): refused"
            )

    @property
    def as_of(self) -> int:
        """The round whose end state the node starts from: ``state_round``, else the round before."""
        return self.server_round - 1 if self.state_round is None else self.state_round

    def to_record(self) -> ConfigRecord:
        """The record a server sends: the values that differ from their defaults, and always those of :data:`ALWAYS`.

        ``RoundConfig.parse(cfg.to_record(), node)`` gives ``cfg`` back; booleans go as 0 / 1.
        """
        out: dict[str, int | float | str | list[float]] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ALWAYS or value != f.default:
                value = list(value) if isinstance(value, tuple) else value
                out[KEYS.get(f.name, f.name.replace("_", "-"))] = int(value) if isinstance(value, bool) else value
        return ConfigRecord(out)


ALWAYS = frozenset({"server_round", "version", "seed", "beta1", "beta2"})  # sent even where default
KEYS = {"checksum": "x-checksum"}  # wire keys that are not the field's name with '-' for '_'


@dataclass(frozen=True)
class ReplyMetrics:
    """What a node reports with its upload (``protocol``'s ``dlion.metrics``).

    Attributes
    ----------
    num_examples : int
        Examples in the round's batches, >= 1.
    train_loss : float
        Their mean loss.
    version, checksum : int
        The version of the replica the node computed δ at, and the CRC-32 of its x.
    coin_flips : int
        Signs sent as coin flips (exact zeros of the Lion mix).
    context : int | None
        The version whose two last Δs the node holds (the next Δ can be coded with them); None: none.
    flips_explained : dict
        Where the coin flips come from (:func:`flower_dlion.coin_flips.explain`'s ``coin-flips-*``
        metrics), when there are many; empty otherwise.

    """

    num_examples: int
    train_loss: float
    version: int
    checksum: int
    coin_flips: int = 0
    context: int | None = None
    flips_explained: Mapping[str, int | float] = field(default_factory=dict)

    def to_record(self) -> MetricRecord:
        """The reply's MetricRecord (``context`` only where there is one)."""
        out: dict[str, int | float] = {
            "num-examples": self.num_examples,
            "train-loss": self.train_loss,
            "version": self.version,
            "checksum": self.checksum,
            "coin-flips": self.coin_flips,
        }
        if self.context is not None:
            out["context"] = self.context
        return MetricRecord(out | dict(self.flips_explained))

    @classmethod
    def from_record(cls, content: RecordDict) -> ReplyMetrics:
        """The reply's metrics, checked (:func:`~.protocol.read_metrics`); raises RejectedReply naming the problem."""
        values = read_metrics(content, METRICS, REPLY_METRICS, optional=OPTIONAL_REPLY_METRICS)
        for key in ("version", "checksum", "coin-flips", "context"):
            if key in values and not isinstance(values[key], int):
                raise RejectedReply(f"metric {key!r} is {values[key]!r}, expected an integer")
        return cls(
            num_examples=int(values["num-examples"]),
            train_loss=float(values["train-loss"]),
            version=int(values["version"]),
            checksum=int(values["checksum"]),
            coin_flips=int(values.get("coin-flips", 0)),
            context=None if "context" not in values else int(values["context"]),
            flips_explained={k: values[k] for k in EXPLAINED_FLIPS if k in values},
        )


_MISSING = object()


class _Reader:
    """Reads one key at a time from a config record, with the node named in every error."""

    def __init__(self, record: Mapping[str, Any], node_id: int) -> None:
        self.record = record
        self.node_id = node_id

    def _get(self, key: str, default: Any, optional: bool = False) -> Any:
        value = self.record.get(key, _MISSING)
        if value is _MISSING:
            if default is None and not optional:
                raise ClientStateError(f"node {self.node_id}: the server's train config has no {key!r}: refused")
            return default
        return value

    def _refuse(self, key: str, value: Any, allowed: str) -> ClientStateError:
        return ClientStateError(f"node {self.node_id}: the server sent {key} = {value!r} ({allowed} allowed): refused")

    def int(self, key: str, default: int | None, *, low: int, high: int = INT_LIMIT, optional: bool = False) -> Any:
        value = self._get(key, default, optional)
        if value is None:
            return None
        if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
            raise self._refuse(key, value, f"an int in [{low}, {high}]")
        return value

    def float(
        self, key: str, default: float | None, *, low: float, high: float = math.inf, below: float | None = None
    ) -> float:
        value = self._get(key, default)
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and low <= value <= high and (below is None or value < below)
        if not ok:
            allowed = f"a finite number in [{low:g}, {below:g})" if below is not None else f"a finite number >= {low:g}"
            if below is None and high < math.inf:
                allowed = f"a finite number in [{low:g}, {high:g}]"
            raise self._refuse(key, value, allowed)
        return float(value)

    def floats(self, key: str, *, high: float) -> tuple[float, ...]:
        value = self._get(key, [])
        ok = isinstance(value, list) and len(value) <= 1 << 20
        if not (ok and all(isinstance(v, float) and math.isfinite(v) and 0.0 <= v <= high for v in value)):
            shown = [*value[:8], "…"] if isinstance(value, list) and len(value) > 8 else value
            raise self._refuse(key, shown, f"a list of floats in [0, {high:g}]")
        return tuple(value)

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        value = self._get(key, default)
        if value not in choices:
            raise self._refuse(key, value, f"one of {choices}")
        return str(value)

    def flag(self, key: str) -> bool:
        value = self._get(key, 0)
        if not (isinstance(value, int | bool) and value in (0, 1)):
            raise self._refuse(key, value, "0 or 1")
        return bool(value)

    def state_key(self) -> str:
        value = self.text("state-key", "")
        if value and not STATE_KEY.fullmatch(value):
            raise self._refuse("state-key", value, "a folder name of 1 to 64 letters, digits, '_' or '-'")
        return value

    def text(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not (isinstance(value, str) and len(value) <= 4096):
            raise self._refuse(key, value, "a string of at most 4096 characters")
        return value


def hello_keys(record: Mapping[str, Any], node_id: int) -> tuple[str, int | None]:
    """The run's ``state-key`` and ``state-round`` from a hello, checked as in a train message ("" and None: absent)."""
    r = _Reader(record, node_id)
    return r.state_key(), r.int("state-round", None, low=-1, optional=True)
