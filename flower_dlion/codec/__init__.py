"""Bit codec for Distributed Lion: what a sign vector and a broadcast Δ look like on the wire.

Imports torch and numpy only (never flwr), so it runs on a GPU box, in a benchmark, or
on the server alike. Every function is device-agnostic: it runs where its input tensor
lives, so a CUDA client packs on the GPU and ships only the packed bytes to the host.

Formats (``d`` values, bytes in big-endian bit order, the same layout as
``numpy.packbits(..., bitorder="big")``):

============  ==========================  ==========================================
stype         values                      size in bytes
============  ==========================  ==========================================
``sign1``     {-1, +1}: bit 1 means +1    ⌈d/8⌉
``trit5``     3 levels, 5 per byte (3⁵≤256)  ⌈d/5⌉            (1.6 bits/value)
``planesB``   2ᴮ levels, B bit planes     B·⌈d/8⌉          (B bits/value)
============  ==========================  ==========================================

A broadcast Δ is sent as integer *levels* ``k ∈ {0, …, L-1}`` with
``Δ = (2k − (L−1)) / (L−1)``: the vote uses L = 3 ({-1, 0, +1}) or L = 2 when no tie is
possible (odd number of voters), the mean over n votes uses L = n + 1. The smallest of
the formats above that fits L is used (:func:`level_format`).

Each function here is the reference: numpy on the CPU (on torch's threads, in chunks), tensor
operations elsewhere. Where a faster way computes exactly the same bytes and floats — fused
numba kernels on the CPU, Triton kernels on a CUDA device — the function asks
:func:`flower_dlion.accel.choose` for it and runs it instead; everything about speed lives in
:mod:`flower_dlion.accel`, and ``FLOWER_DLION_KERNELS`` (``auto``, ``on``, ``off``) picks.

Three modules, one per side of the wire: :mod:`.signs` (a client's δ: pack, unpack, coin flips,
the fused Lion step + pack), :mod:`.votes` (the server's count of n payloads and the vote's or
the mean's levels from it), :mod:`.levels` (Δ's levels: encode, decode, apply). The formats'
names, sizes, trit table and level values live below both this package and the twins, in
:mod:`flower_dlion.formats` (a twin never imports the codec), and are re-exported here.
"""

from ..formats import (
    POW3,
    SIGN1,
    TRIT5,
    as_uint8,
    check_levels,
    encoded_size,
    level_format,
    levels_to_values,
    packed_size,
    trit_table,
    zero_mask_words,
)
from .levels import apply_levels_, decode_levels, encode_levels, planes_to_counts
from .signs import (
    count_mask_bits,
    pack_bits,
    pack_local_step_,
    pack_signs,
    set_coin_flips,
    unpack_bits,
    unpack_signs,
)
from .votes import PackedAggregate, aggregate_counts, aggregate_packed, count_ones, count_planes, majority_masks

__all__ = [  # with the formats' shared definitions (flower_dlion.formats), re-exported
    "POW3",
    "SIGN1",
    "TRIT5",
    "PackedAggregate",
    "aggregate_counts",
    "aggregate_packed",
    "apply_levels_",
    "as_uint8",
    "check_levels",
    "count_mask_bits",
    "count_ones",
    "count_planes",
    "decode_levels",
    "encode_levels",
    "encoded_size",
    "level_format",
    "levels_to_values",
    "majority_masks",
    "pack_bits",
    "pack_local_step_",
    "pack_signs",
    "packed_size",
    "planes_to_counts",
    "set_coin_flips",
    "trit_table",
    "unpack_bits",
    "unpack_signs",
    "zero_mask_words",
]
