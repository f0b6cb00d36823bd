"""The client's extension point for fault studies: :class:`UploadHook`, what a node changes in what it sends.

``DLionClient.train(..., tamper=hook)`` runs one; the library's own code never makes one. The
fault studies' attackers (sign flips, random signs, scale and momentum lies, "a little is
enough") are the app's (``flower_dlion_app.clients.attacks``), built on this class.
"""

from __future__ import annotations

import torch
from flwr.app import Array

__all__ = ["Tamper", "UploadHook"]


class UploadHook:
    """An extension point for fault studies: what a node changes in what it sends (this base changes nothing).

    Pass an instance as ``DLionClient.train(..., tamper=hook)``; subclass it and override either
    method (the fault studies' attackers: ``flower_dlion_app.clients.attacks``). Each is called
    once per ``train`` message, on the message's thread, in this order:

    1. :meth:`upload`, after the K local steps and before U is encoded for the wire (a round
       with a hook never takes the fused one-pass sign path, whose U is never formed);
    2. :meth:`arrays`, after the reply's arrays are encoded (and the momentum or buffers
       added in the rounds that sync them), before secure aggregation masks them.

    Neither may change the node's state (x, m, e): they change only what is sent.
    """

    def upload(self, u: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """What the node uploads instead of U.

        Parameters
        ----------
        u : torch.Tensor
            U = Σₖ δₖ, float32 (d,) on the client's device (with ``local-optimizer = "sgd"``
            and ``upload = "ef-sign"``: the SGD steps' change g). Return a new tensor, or ``u``.
        generator : torch.Generator
            The round's seeded generator (the coin flips of exact zeros): random choices drawn
            from it are the same in a rerun.

        Returns
        -------
        torch.Tensor
            What is encoded in place of U (same shape, dtype and device).

        """
        return u

    def arrays(self, arrays: dict[str, Array]) -> dict[str, Array]:
        """The reply's arrays as sent.

        Parameters
        ----------
        arrays : dict[str, Array]
            The encoded upload (``signs`` or ``levels``, ``scales``) and, in the rounds that
            send them, ``momentum`` and ``buffers``; it may be changed in place.

        Returns
        -------
        dict[str, Array]
            What the reply carries.

        """
        return arrays


Tamper = UploadHook  # the name the fault studies used first
