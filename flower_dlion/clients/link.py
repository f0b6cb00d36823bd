"""Whether a client asks for its next Δ coded with the two before it as context: only where it saves time.

An in-sync node of the anchored downlink receives each round's Δ as its packed levels (1.6 bits a
value where the vote can tie, 1 where it cannot), applied on its device in one pass. If it asks
(the ``context`` metric of its reply), the server codes the Δ instead with the two Δs before it
as context: about 1.2–1.4 bits a value, but an ANS decode of every value on the host (about 35 ns
a value on a 2-core CPU, docs/PERFORMANCE.md §6), plus keeping that context. The bytes saved
are worth the decode only on a slow link, so a client asks while

    seconds to apply a context-coded Δ  <  bytes it saved · 8 / (link_mbps · 10⁶)

measured on its own Δs (the first one is tried; every :data:`REPROBE` rounds it measures again).
Its link is what the client is told (``DLionClient(link_mbps=...)``, or the node config's
``link-mbps``): a client not told never asks and keeps no context.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import Context

from ..anchored_counts import Segment
from ..codec import encoded_size
from ..protocol import ClientStateError
from .settings import positive

__all__ = ["REPROBE", "ContextChoice", "DecodeCost", "node_choice"]

REPROBE = 50  # rounds without the context coding before it is measured again


@dataclass
class DecodeCost:
    """What a context-coded Δ cost the last time one was applied in this process, and what it saved."""

    seconds_per_value: float | None = None  # applying it: decode, counts, x (the last one measured)
    saved_per_value: float | None = None  # bytes it saved against the packed levels


class ContextChoice:
    """One node's choice, from its link and what the context coding costs this process.

    Parameters
    ----------
    link_mbps : float | None
        The node's downlink in Mbit/s; None: unknown (the node never asks for the context coding).
    cost : DecodeCost
        Shared by the nodes of one client in this process (one of them measures it for all: the
        others get the replica it made).

    """

    def __init__(self, link_mbps: float | None, cost: DecodeCost) -> None:
        self.link_mbps = link_mbps
        self.cost = cost
        self.declined = 0  # rounds declined since the last measurement

    @property
    def seconds_per_value(self) -> float | None:
        """Seconds a context-coded Δ took to apply, per value (None: not measured yet)."""
        return self.cost.seconds_per_value

    @property
    def saved_per_value(self) -> float | None:
        """Bytes it saved per value against the packed levels."""
        return self.cost.saved_per_value

    @property
    def keeps(self) -> bool:
        """Whether the client keeps the coder context (it may ask for the coding within two rounds)."""
        if self.link_mbps is None:
            return False
        return self.seconds_per_value is None or self.pays() or self.declined >= REPROBE - 2

    def pays(self) -> bool:
        """Whether the last measurement says the context coding saves time on this link."""
        if self.link_mbps is None or self.seconds_per_value is None or self.saved_per_value is None:
            return False
        return self.seconds_per_value < self.saved_per_value * 8 / (self.link_mbps * 1e6)

    def wanted(self) -> bool:
        """Whether to ask for the next Δ coded with context (called once a round, by a node that could decode it)."""
        if self.link_mbps is None:
            return False
        if self.seconds_per_value is None or self.pays():
            return True
        self.declined += 1
        if self.declined >= REPROBE:  # measure again: the link or the machine may have changed
            self.declined = 0
            return True
        return False

    def observe(self, segment: Segment, seconds: float, d: int) -> None:
        """A one-Δ segment was applied in ``seconds``; a context-coded one updates the measurement."""
        if segment.context:
            self.cost.seconds_per_value = seconds / d
            self.cost.saved_per_value = (encoded_size(d, 3) - len(segment.payload)) / d


def node_choice(
    choices: dict[str, ContextChoice], cost: DecodeCost, owner: str, link_mbps: float | None, context: Context
) -> ContextChoice:
    """``owner``'s context-coding choice, kept in ``choices`` (per node: each has its own link).

    ``link_mbps``: the client's setting; None reads the node config's ``link-mbps`` (if any).
    """
    link = link_mbps
    if link is None and "link-mbps" in context.node_config:
        link = float(context.node_config["link-mbps"])
        if not positive(link):
            raise ClientStateError(f"node {context.node_id}: node config link-mbps = {link!r} (a number > 0)")
    choice = choices.get(owner)
    if choice is None or choice.link_mbps != link:
        choice = choices[owner] = ContextChoice(link, cost)
    return choice
