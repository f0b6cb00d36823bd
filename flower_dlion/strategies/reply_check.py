"""The check of a round's replies for Distributed Lion: each reply refused or parsed, and what the replies say.

:class:`ReplyCheck` is given the strategy's options, its :class:`~.server_state.ServerState` and its
:class:`~.global_model.GlobalModel` (``DistributedLion.check``). ``DistributedLion.aggregate_train``
hands it the round's replies once, sorted (:func:`~.replies.sort_replies`), and every later step of
the round reads what :meth:`ReplyCheck.check_replies` returns, a :class:`CheckedRound`:

- each reply read once and checked (:meth:`ReplyCheck.check_reply`, a :class:`CheckedReply`): its
  bytes and the failed state write it reports, then its envelope, arrays and metrics
  (:mod:`flower_dlion.protocol`), its coin-flips metrics against the model
  (:meth:`~.global_model.GlobalModel.check_flips`) and its replica against the round's base
  (:meth:`~.server_state.Round.check_base`); a refused one may show that its node's replica is lost
  (:meth:`~.server_state.ServerState.on_rejected`: the full model next time);
- the state writes the nodes report as failed, and whether the run must stop for them (:mod:`.state_writes`);
- what the replies measure for the round's row: their bytes, the error replies.

A reply goes down these modules once, in this order: the check's own steps, the protocol's reading
of the message, what the model, the round and the server state make of it, the state writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import WARNING

from flwr.app import Message
from flwr.supercore import log

from ..bounds import moment_count
from ..protocol import (
    CLIENT_UPLOAD,
    MASKED_STYPE,
    METRICS,
    NOTICE,
    OPTIONAL_REPLY_METRICS,
    REPLY_METRICS,
    RejectedReply,
    WriteFailure,
    check_envelope,
    message_bytes,
    read_metrics,
    read_notice,
    read_upload,
)
from ..secure import masking
from ..uploads import Parsed, Shape, upload_kind
from .global_model import GlobalModel
from .options import Options
from .replies import SECOND_REPLY, CheckedReplies, Reply
from .run_stops import RunStopped
from .server_state import Round, RoundCounts, ServerState, ValidReply
from .state_writes import StateWrites, note

__all__ = ["CheckedReply", "CheckedRound", "ReplyCheck"]

SEED_FIX = (  # said once a run, when a node's x₀ from init_seed differs from initial_arrays
    "node {node} built x₀ with torch.manual_seed({seed}) and got a different model than initial_arrays: "
    "with init_seed={seed}, build initial_arrays the way the clients build their model, after the same "
    "seed (torch.manual_seed({seed}); ArrayRecord(Net().state_dict())), or leave init_seed=None. Until then "
    "each such node's first reply is lost and it is sent the full float32 model instead of the seed"
)


@dataclass(frozen=True)
class CheckedReply:
    """One reply as its check left it: parsed or refused, and what it says either way.

    Attributes
    ----------
    outcome : ValidReply | RejectedReply
        The reply parsed, or why it is refused.
    bytes : int
        What it put on the wire (``bytes-up``).
    notice : WriteFailure | RejectedReply | None
        The failed state write it reports (:func:`~flower_dlion.protocol.read_notice`; :func:`.state_writes.note`).

    """

    outcome: ValidReply | RejectedReply
    bytes: int
    notice: WriteFailure | RejectedReply | None


@dataclass
class CheckedRound:
    """A round's replies as the check left them: what every later step of ``aggregate_train`` reads.

    Attributes
    ----------
    replies : CheckedReplies[ValidReply]
        The valid replies parsed (in arrival order), the refused ones with why, the nodes that answered.
    valid : list[ValidReply]
        The valid replies by node id: a fixed order, so that float sums are reproducible.
    bytes_up : int
        The bytes of every reply, valid or not (``bytes-up``).
    errors : list[int]
        The senders of the error replies (``client-errors``; secure aggregation re-keys them).
    stop : RunStopped | None
        The stop the state writes ask for: every node that answered could not write its state.

    """

    replies: CheckedReplies[ValidReply]
    valid: list[ValidReply]
    bytes_up: int
    errors: list[int]
    stop: RunStopped | None


class ReplyCheck:
    """The check of Distributed Lion's replies (``strategy.check``): each one refused or parsed.

    Parameters
    ----------
    options : Options
        The strategy's options (read-only).
    state : ServerState
        The server's state, shared with the links: a refused reply may forget its node's replica.
    model : GlobalModel
        The strategy's model: d, the layout, the momentum mask, the buffers' description.

    """

    def __init__(self, options: Options, state: ServerState, model: GlobalModel) -> None:
        self.options = options
        self.state = state
        self.model = model
        self.kind = upload_kind(options.uplink.upload)
        self.told_seed = False  # the init-seed mismatch warning was logged
        self.writes = StateWrites()  # the failed state writes nodes reported

    @property
    def shape(self) -> Shape:
        """The model's size and K, as the upload kinds take them."""
        return self.model.shape(self.options.uplink.scale_block, self.options.local.lion_steps)

    def check_replies(self, arrived: list[Reply], rnd: Round, counts: RoundCounts) -> CheckedRound:
        """Each reply checked (:meth:`check_reply`), what the refused ones say of their node, and what the replies say.

        A refused reply of a node sampled this round may show that its replica is lost
        (:meth:`~.server_state.ServerState.on_rejected`). The state writes the replies report as
        failed are counted in ``counts`` and may stop the run (``CheckedRound.stop``).
        """
        checked: CheckedReplies[ValidReply] = CheckedReplies(answered={reply.node_id for reply in arrived})
        each = [self.check_reply(reply.msg, rnd, again=reply.again) for reply in arrived]
        for reply, one in zip(arrived, each, strict=True):
            if isinstance(one.outcome, ValidReply):
                checked.valid.append(one.outcome)
                continue
            checked.refused.append((reply, one.outcome))
            if reply.node_id not in rnd.sent or reply.again:
                continue  # a stray reply says nothing about the node's replica
            msg, node_id, pid = reply.msg, reply.node_id, reply.partition
            reason = msg.error.reason if msg.has_error() else ""
            seed_lost = self.state.on_rejected(pid, one.outcome, reason, counts, seeded=node_id in rnd.seeded)
            note(counts.write_failures, rnd.server_round, one.notice, node_id, pid)  # it could not write its state
            if seed_lost and not self.told_seed:  # say once why, and the fix
                self.told_seed = True
                log(WARNING, SEED_FIX.format(node=node_id, seed=self.options.downlink.init_seed))
        for reply, one in zip(arrived, each, strict=True):  # the refused ones were noted above, with their partition
            msg, sender = reply.msg, reply.msg.metadata.src_node_id
            if not msg.has_error() and NOTICE in msg.content and sender in rnd.sent:
                note(counts.write_failures, rnd.server_round, one.notice, sender)
        stop = self.writes.close(counts.write_failures, rnd.server_round, checked.answered & rnd.sent.keys())
        return CheckedRound(
            replies=checked,
            valid=sorted(checked.valid, key=lambda r: r.node_id),
            bytes_up=sum(one.bytes for one in each),
            errors=[reply.msg.metadata.src_node_id for reply in arrived if reply.msg.has_error()],
            stop=stop,
        )

    def check_reply(self, msg: Message, rnd: Round, *, again: bool = False) -> CheckedReply:
        """Read one reply and check it: parsed, or refused for the first check it fails.

        Its bytes and the failed state write it reports are read whatever the check finds. The
        checks, in their order: a node's second reply of the round (``again``) is refused
        unchecked; then the envelope, the upload's arrays and the metrics
        (:mod:`flower_dlion.protocol`; between the last two, the upload itself: the upload kind's
        ``parse``), the coin-flips metrics against the model, and the replica against the
        round's base.
        """
        expected = self._expected_arrays(rnd)
        size, notice = message_bytes(msg), read_notice(msg)
        try:
            if again:
                raise RejectedReply(SECOND_REPLY)
            check_envelope(msg, rnd.sent.keys(), rnd.server_round, (CLIENT_UPLOAD, METRICS), optional=(NOTICE,))
            floats = read_upload(msg.content, expected, self.model.num_parameters)
            record = msg.content[CLIENT_UPLOAD]  # an ArrayRecord of the expected arrays
            if "masked" in expected:  # uniform in Z_{2^b} whatever the signs: nothing more to check
                upload = Parsed(record["masked"].data)
            else:
                upload = self.kind.parse(record[self.kind.main].data, floats, self.shape)
            values = read_metrics(msg.content, METRICS, REPLY_METRICS, optional=OPTIONAL_REPLY_METRICS)
            self.model.check_flips(values)
            rnd.check_base(values)
        except RejectedReply as err:
            return CheckedReply(err, size, notice)
        momentum, buffers = floats.get("momentum"), floats.get("buffers")
        masked = record["masked-buffers"].data if "masked-buffers" in expected else None
        valid = ValidReply(msg.metadata.src_node_id, upload, momentum, buffers, values, masked)
        return CheckedReply(valid, size, notice)

    def _expected_arrays(self, rnd: Round) -> dict[str, tuple[str, str, int]]:
        """Array name → (stype or "", dtype, bytes) that a valid reply holds this round."""
        if self.options.secure.secure:  # b bit planes of the masked signs, b for the round's participants
            bits = masking.mask_bits(max(1, len(rnd.participants)))
            out = {"masked": (MASKED_STYPE, "level", bits * masking.plane_bytes(self.model.num_parameters))}
            if rnd.buffer_sync:  # the buffers' moments in Z_{2^64} (bounds.buffer_moments)
                assert self.model.spec is not None
                out["masked-buffers"] = (MASKED_STYPE, "uint64", 8 * moment_count(self.model.spec))
            return out
        out = self.kind.expected(self.shape)
        if rnd.momentum_sync:
            assert self.model.momentum_mask is not None
            out["momentum"] = ("numpy.ndarray", "float32", 4 * int(self.model.momentum_mask.sum()))
        if rnd.buffer_sync:
            assert self.model.spec is not None
            out["buffers"] = ("numpy.ndarray", "float32", 4 * self.model.spec.num_buffer_values)
        return out
