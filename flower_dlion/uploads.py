"""What a client sends for its K local Lion steps, U = Σₖ δₖ: one object per upload kind.

Each kind is used by the client (:meth:`Upload.encode`) and by the strategy
(:meth:`Upload.expected`, :meth:`Upload.parse`, :meth:`Upload.total`) alike, so the two
sides cannot disagree on the format. What S becomes (Δ's levels) is not decided here:
:mod:`flower_dlion.strategies.server_delta` does it, in one place for every kind.

=============  ======================================  ============================  ===========================
kind           what a client sends                     bytes for d parameters        S = Σᵢ Uᵢ on the server
=============  ======================================  ============================  ===========================
``sign``       sign(U) (K = 1: δ), 1 bit each           ⌈d/8⌉                         Σ of ±1, int32
``sum``        U itself, 2K + 1 levels (FedLion)        ⌈log₂(2K+1)⌉ bit planes       Σ Uᵢ, int32
``ef-sign``    sign(U + e) with one scale per tensor,   ⌈d/8⌉ + 4 per tensor          Σ ±sᵢⱼ, float32, each scale
               error feedback e ← U + e − sent                                         cut to the round's median
=============  ======================================  ============================  ===========================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from flwr.app import Array

from . import codec, quantizers
from .bounds import clip_scales
from .lion import Perturb
from .protocol import LEVELS_STYPE, SIGN_STYPE, RejectedReply, bits_array

__all__ = ["UPLOADS", "EfSignUpload", "Parsed", "Shape", "SignUpload", "SumUpload", "Upload", "upload_kind"]

Expected = dict[str, tuple[str, str, int]]  # array name → (stype, dtype, bytes)


@dataclass(frozen=True)
class Shape:
    """What both sides know of an upload before it is sent: the model's size and the round's K."""

    d: int  # trainable values
    sizes: list[int]  # values per tensor (ef-sign: one scale each)
    steps: int  # K local steps: U ∈ [−K, K]


@dataclass
class Parsed:
    """The upload part of a validated reply."""

    data: bytes  # the packed signs or the encoded levels, as received
    levels: torch.Tensor | None = None  # sum: the decoded levels Uᵢ + K (decoded once, when validated)
    scales: torch.Tensor | None = None  # ef-sign: one float32 per tensor


class Upload:
    """One upload kind: its arrays, how a client encodes U, how the server sums the replies."""

    name: ClassVar[str]
    main: ClassVar[str] = "signs"  # the array holding the per-parameter payload

    def expected(self, shape: Shape) -> Expected:
        """The arrays a valid reply holds for this kind (besides momenta and buffers)."""
        return {"signs": (SIGN_STYPE, "bit", codec.packed_size(shape.d))}

    def encode(
        self,
        u: torch.Tensor,
        error: torch.Tensor | None,
        shape: Shape,
        generator: torch.Generator,
        flips: list[int],
        perturb: Perturb | None = None,
    ) -> tuple[dict[str, Array], torch.Tensor | None]:
        """The reply's arrays for U, and the client's error state after it (``None``: none kept).

        ``perturb``: the stochastic sign of the ef-sign upload (:mod:`flower_dlion.stochastic`); the
        sign upload's noise is in its Lion steps, so the other kinds take none.
        """
        raise NotImplementedError

    def parse(self, data: bytes, floats: dict[str, torch.Tensor], shape: Shape) -> Parsed:
        """The validated upload of one reply (arrays already checked against :meth:`expected`)."""
        return Parsed(data)

    def total(self, replies: list[Parsed], shape: Shape) -> tuple[torch.Tensor, int]:
        """S = Σᵢ Uᵢ of the valid replies, and the number of scales cut to the median."""
        raise NotImplementedError

    def max_abs(self, steps: int) -> int | None:
        """The largest |Uᵢ| per coordinate (``k`` of ``lion.aggregate``); ``None``: S is not integer."""
        return 1

    def agreement_scale(self, steps: int) -> float:
        """:meth:`max_abs` as a float: agreement is mean |S| / (n · this); NaN when S is not integer."""
        bound = self.max_abs(steps)
        return float("nan") if bound is None else float(bound)


class SignUpload(Upload):
    """sign(U), one bit per parameter (a coin flip where U is exactly 0)."""

    name = "sign"

    def encode(
        self,
        u: torch.Tensor,
        error: torch.Tensor | None,
        shape: Shape,
        generator: torch.Generator,
        flips: list[int],
        perturb: Perturb | None = None,
    ) -> tuple[dict[str, Array], torch.Tensor | None]:
        """sign(U) packed, 8 per byte."""
        packed = codec.pack_signs(u, generator=generator, flips=flips)
        return {"signs": bits_array(packed, u.numel(), SIGN_STYPE)}, error

    def total(self, replies: list[Parsed], shape: Shape) -> tuple[torch.Tensor, int]:
        """2 · (votes for +1) − n, counted on the packed bits."""
        n = len(replies)
        return codec.count_ones([r.data for r in replies], shape.d).mul_(2).sub_(n), 0  # Σ of ±1: 2·(votes for +1) − n


class SumUpload(Upload):
    """U itself as 2K + 1 levels (U + K ∈ 0 … 2K)."""

    name = "sum"
    main = "levels"

    def expected(self, shape: Shape) -> Expected:
        """Array 'levels'."""
        return {"levels": (LEVELS_STYPE, "level", codec.encoded_size(shape.d, 2 * shape.steps + 1))}

    def encode(
        self,
        u: torch.Tensor,
        error: torch.Tensor | None,
        shape: Shape,
        generator: torch.Generator,
        flips: list[int],
        perturb: Perturb | None = None,
    ) -> tuple[dict[str, Array], torch.Tensor | None]:
        """U + K as 2K + 1 levels."""
        levels = (u + shape.steps).to(torch.int32)  # U ∈ [−K, K] → 0 … 2K
        encoded = codec.encode_levels(levels, 2 * shape.steps + 1)
        return {"levels": bits_array(encoded, u.numel(), LEVELS_STYPE, dtype="level")}, error

    def parse(self, data: bytes, floats: dict[str, torch.Tensor], shape: Shape) -> Parsed:
        """The levels decoded once (a level above 2K: a corrupted payload, refused)."""
        try:  # a level above 2K means a corrupted payload
            return Parsed(data, levels=codec.decode_levels(data, 2 * shape.steps + 1, shape.d))
        except ValueError as err:
            raise RejectedReply(f"Array 'levels': {err}") from err

    def total(self, replies: list[Parsed], shape: Shape) -> tuple[torch.Tensor, int]:
        """Σᵢ (levels − K)."""
        total = torch.zeros(shape.d, dtype=torch.int32)
        for r in replies:
            assert r.levels is not None
            total += r.levels - shape.steps  # Uᵢ ∈ [−K, K]
        return total, 0

    def max_abs(self, steps: int) -> int | None:
        """K."""
        return steps


class EfSignUpload(Upload):
    """A scaled sign of U + e, one scale per tensor (the mean |U + e| of the tensor), with error feedback."""

    name = "ef-sign"

    def expected(self, shape: Shape) -> Expected:
        """Array 'signs' and Array 'scales'."""
        return super().expected(shape) | {"scales": ("numpy.ndarray", "float32", 4 * len(shape.sizes))}

    def encode(
        self,
        u: torch.Tensor,
        error: torch.Tensor | None,
        shape: Shape,
        generator: torch.Generator,
        flips: list[int],
        perturb: Perturb | None = None,
    ) -> tuple[dict[str, Array], torch.Tensor | None]:
        """sign(U + e) packed, the per-tensor scales, and e ← U + e − what was sent."""
        if error is None:
            error = torch.zeros_like(u)
        levels, scales = quantizers.ef_quantize_(u, error, shape.sizes, 2, perturb)  # scaled sign of U + e; e ← rest
        arrays = {
            "signs": bits_array(codec.pack_bits(levels > 0), u.numel(), SIGN_STYPE),
            "scales": Array(scales.cpu().numpy().astype(np.float32)),
        }
        return arrays, error

    def parse(self, data: bytes, floats: dict[str, torch.Tensor], shape: Shape) -> Parsed:
        """The signs and the scales."""
        return Parsed(data, scales=floats["scales"])

    def total(self, replies: list[Parsed], shape: Shape) -> tuple[torch.Tensor, int]:
        """Σᵢ ±sᵢⱼ with the scales cut to the round's lower median per tensor (``bounds.clip_scales``)."""
        total = torch.zeros(shape.d, dtype=torch.float32)
        scales, clipped = clip_scales(torch.stack([r.scales for r in replies if r.scales is not None]))
        for r, s in zip(replies, scales, strict=True):
            bits = codec.unpack_bits(r.data, shape.d).to(torch.int32)
            total += quantizers.dequantize(bits, 2, s, shape.sizes)  # ±sⱼ, sⱼ at most the median's
        return total, clipped

    def max_abs(self, steps: int) -> int | None:
        """None: S is a float sum of scaled signs."""
        return None


UPLOADS: dict[str, Upload] = {kind.name: kind for kind in (SignUpload(), SumUpload(), EfSignUpload())}


def upload_kind(name: str) -> Upload:
    """The upload kind called ``name``; a ``ValueError`` naming the choices otherwise."""
    if name not in UPLOADS:
        raise ValueError(f"upload must be one of {', '.join(map(repr, UPLOADS))}, got {name!r}")
    return UPLOADS[name]
