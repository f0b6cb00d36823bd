"""Pairwise additive masks over Z_{2^b}, bit-sliced: what a client adds to its signs and the server takes off.

A round's n participants each hold a value ``xᵢ ∈ {0, 1}`` per coordinate (their sign bit: 1 for
+1) and upload ``yᵢ = xᵢ + Σⱼ σᵢⱼ·Mᵢⱼ mod 2ᵇ`` with ``b = ⌈log₂(n+1)⌉`` (:func:`mask_bits`), where
j runs over i's neighbours in the round, ``σᵢⱼ = +1`` if i's key is below j's and −1 otherwise, and
``Mᵢⱼ = Mⱼᵢ`` is uniform in Z_{2^b}. The masks cancel in the sum: ``Σᵢ yᵢ = Σᵢ xᵢ = c`` (mod 2ᵇ, and
c ≤ n < 2ᵇ), the per-coordinate count of +1 signs that the vote and the mean need
(:func:`flower_dlion.codec.aggregate_counts`). A single yᵢ is uniform whatever xᵢ is.

Everything stays *bit-sliced*: a vector of d values in Z_{2^b} is b bit planes of ⌈d/8⌉ bytes
(plane j packs bit j of every value, MSB first in each byte, as :func:`numpy.packbits`; the
``planesB`` layout of :mod:`flower_dlion.codec`), a client's x is its packed signs as plane 0, a mask
is b·⌈d/8⌉ keystream bytes read as planes, and sums are ripple-carry adds on 64-bit words
(:func:`add_planes_`): nobody unpacks d values.

Keys and secrecy per round (docs/USER_GUIDE.md, "Secure aggregation"): a pair's long-lived secret is
``HKDF-SHA256(X25519(skᵢ, pkⱼ), info = run key)`` (:func:`pair_seed`), which never leaves either node.
Its **round seed** is ``SHA-256(label ‖ secret ‖ round)`` (:func:`round_seed`), one-way: revealing
round t's seed (what a survivor does for a neighbour that dropped out of round t) says nothing
of any other round's. ``Mᵢⱼ`` is ChaCha20's keystream under the round seed (:func:`mask_stream`).
Each client also adds a **self-mask**, the keystream of a seed it draws fresh for the round and
reveals only as a survivor of that round (SecAgg's double masking): the server never holds
both what takes off a node's pairwise masks and what takes off its self-mask.
X25519, HKDF and ChaCha20 come from the ``cryptography`` package, no primitive of our own.
Imports numpy and cryptography only.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = [
    "BUFFER_RANGE",
    "BUFFER_SCALE",
    "MAX_BITS",
    "MIN_PARTICIPANTS",
    "MIN_SURVIVORS",
    "SEED_BYTES",
    "add_planes_",
    "buffer_mask",
    "from_fixed_mean",
    "mask_bits",
    "mask_stream",
    "masked_planes",
    "neighbours",
    "pair_seed",
    "plane_bytes",
    "planes_bytes",
    "round_mask",
    "round_seed",
    "sum_planes",
    "to_fixed",
]

MAX_BITS = 16  # b ≤ 16: up to 65 535 clients a round
MIN_PARTICIPANTS = 3  # a masked round of two would show each client the other's signs (the sum minus its own)
MIN_SURVIVORS = 3  # unmasking a round of two survivors would show each the other's signs (Δ minus its own)
BUFFER_RANGE = float(1 << 20)  # buffers are summed as fixed point in Z_{2^64}: each value clipped to ±2²⁰,
BUFFER_SCALE = float(1 << 26)  # in steps of 2⁻²⁶; n < 2¹⁶ clients keep |Σ| < 2⁶² (no wrap)

_MASK_INFO = b"flower-dlion mask v1"
_ROUND_LABEL = b"flower-dlion round seed v2"
SEED_BYTES = 32  # a round seed, a self-mask seed


def mask_bits(n: int) -> int:
    """B = ⌈log₂(n+1)⌉: the bits that hold a count of n votes (n = 10: 4).

    Raises
    ------
    ValueError
        ``n`` < 1 or more than 2¹⁶ − 1 clients.

    """
    if not 1 <= n < 1 << MAX_BITS:
        raise ValueError(f"a masked round needs 1 to {(1 << MAX_BITS) - 1} clients, got {n}")
    return int(n).bit_length()


def plane_bytes(d: int) -> int:
    """Bytes of one bit plane of d values: ⌈d/8⌉."""
    return -(-d // 8)


def pair_seed(private: X25519PrivateKey, public: bytes, run_key: str) -> bytes:
    """The 32-byte secret two nodes share: HKDF-SHA256 of their X25519 exchange, bound to the run's key.

    Symmetric: ``pair_seed(skᵢ, pkⱼ) == pair_seed(skⱼ, pkᵢ)``.

    Raises
    ------
    ValueError
        ``public`` is not a 32-byte X25519 public key (or is one of the low-order points).

    """
    shared = private.exchange(X25519PublicKey.from_public_bytes(public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_MASK_INFO + run_key.encode()).derive(shared)


def round_seed(seed: bytes, server_round: int) -> bytes:
    """A pair's seed for one round: ``SHA-256(label ‖ seed ‖ round)``, 32 bytes (one-way: it gives no other round's)."""
    return hashlib.sha256(_ROUND_LABEL + seed + struct.pack("<Q", server_round)).digest()


def mask_stream(key: bytes, d: int, bits: int) -> np.ndarray:
    """The mask of a 32-byte round or self-mask seed: b planes of ⌈d/8⌉ bytes of ChaCha20's keystream, (b, ⌈d/8⌉) uint8.

    The seed is the stream's key (each key is used for one round only), the nonce 0.
    """
    if len(key) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(key)}")
    size = bits * plane_bytes(d)
    stream = Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor().update(bytes(size))
    return np.frombuffer(stream, dtype=np.uint8).reshape(bits, -1)


def round_mask(seed: bytes, server_round: int, d: int, bits: int) -> np.ndarray:
    """``M`` of one pair in one round: :func:`mask_stream` of its :func:`round_seed`."""
    return mask_stream(round_seed(seed, server_round), d, bits)


def _words(planes: np.ndarray) -> np.ndarray:
    """(b, ⌈d/8⌉) uint8 planes as (b, words) uint64, zero-padded to whole words (a copy only when padding)."""
    b, nbytes = planes.shape
    if nbytes % 8:
        padded = np.zeros((b, nbytes + 8 - nbytes % 8), dtype=np.uint8)
        padded[:, :nbytes] = planes
        planes = padded
    return np.ascontiguousarray(planes).view(np.uint64)


def add_planes_(acc: np.ndarray, planes: np.ndarray, *, subtract: bool = False) -> None:
    """``acc ← acc + planes`` (or ``− planes``) mod 2ᵇ, per value, on b bit planes: a ripple-carry adder.

    ``acc`` is (b, words) uint64 (see :func:`masked_planes`), ``planes`` (b, ⌈d/8⌉) uint8 or
    (b, words) uint64. Subtraction adds the complement with a carry of 1 into bit 0 (two's
    complement); the carry out of bit b − 1 is dropped (mod 2ᵇ).
    """
    y = planes if planes.dtype == np.uint64 else _words(planes)
    words = acc.shape[1]
    carry = np.full(words, ~np.uint64(0), dtype=np.uint64) if subtract else np.zeros(words, np.uint64)
    bj, half, out = (np.empty(words, np.uint64) for _ in range(3))
    for j in range(acc.shape[0]):
        a = acc[j]
        if subtract:
            np.invert(y[j], out=bj)
        else:
            bj[:] = y[j]
        np.bitwise_xor(a, bj, out=half)
        np.bitwise_and(a, bj, out=out)  # the carry out of bit j: a·b + carry·(a ⊕ b), before a is overwritten
        np.bitwise_xor(a, bj, out=a)
        np.bitwise_xor(a, carry, out=a)
        np.bitwise_and(carry, half, out=carry)
        np.bitwise_or(carry, out, out=carry)


def neighbours(keys: list[int], me: int, degree: int, seed: list[int]) -> list[int]:
    """The nodes ``me`` masks with in a round of ``keys``: all others, or ``degree`` of them (SecAgg+'s graph).

    ``degree`` = 0 or ≥ n − 1: every other participant. Otherwise the participants are put in a
    ring in the order of ``numpy.random.default_rng(seed).permutation`` and each node masks with
    the ``degree // 2`` before and after it (``degree`` rounded down to even, at least 2): a
    ``degree``-regular graph, the same for every node and the server.
    """
    ordered = sorted(keys)
    n = len(ordered)
    if degree == 0 or degree >= n - 1:
        return [k for k in ordered if k != me]
    ring = [ordered[i] for i in np.random.default_rng(seed).permutation(n)]
    at, half = ring.index(me), max(1, degree // 2)
    return sorted({ring[(at + step) % n] for step in range(-half, half + 1) if step})


def masked_planes(signs: np.ndarray, d: int, bits: int, masks: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """A client's masked upload: its packed signs (plane 0) plus ``Σ σⱼ·Mⱼ``, as (b, ⌈d/8⌉) uint8 planes.

    ``signs`` is the ⌈d/8⌉-byte sign upload (bit 1: +1), ``masks`` the pairs (σⱼ ∈ {+1, −1},
    :func:`round_mask` of the pair) with the node's neighbours.
    """
    nbytes = plane_bytes(d)
    if signs.size != nbytes:
        raise ValueError(f"expected {nbytes} bytes of packed signs for d={d}, got {signs.size}")
    x = np.zeros((bits, nbytes), dtype=np.uint8)
    x[0] = signs
    acc = _words(x).copy()
    for sigma, mask in masks:
        add_planes_(acc, mask, subtract=sigma < 0)
    return acc.view(np.uint8)[:, :nbytes].copy()


def sum_planes(payloads: list[np.ndarray], d: int, bits: int) -> np.ndarray:
    """Σ of masked uploads mod 2ᵇ, as (b, words) uint64 planes (the server's running sum)."""
    acc = np.zeros((bits, -(-plane_bytes(d) // 8)), dtype=np.uint64)
    for p in payloads:
        add_planes_(acc, p.reshape(bits, -1))
    return acc


def planes_bytes(acc: np.ndarray, d: int) -> np.ndarray:
    """(b, words) uint64 planes back to (b, ⌈d/8⌉) uint8, the bits past d cleared."""
    out = acc.view(np.uint8)[:, : plane_bytes(d)].copy()
    if d % 8:
        out[:, -1] &= (0xFF00 >> (d % 8)) & 0xFF
    return out


def to_fixed(values: np.ndarray) -> np.ndarray:
    """Floats as fixed point in Z_{2^64} (uint64, two's complement): clipped to ±``BUFFER_RANGE``, steps 2⁻²⁶."""
    clipped = np.clip(np.asarray(values, dtype=np.float64), -BUFFER_RANGE, BUFFER_RANGE)
    return np.rint(clipped * BUFFER_SCALE).astype(np.int64).view(np.uint64)


def from_fixed_mean(total: np.ndarray, n: int) -> np.ndarray:
    """The mean of n values from their fixed-point sum mod 2⁶⁴ (float64)."""
    return total.view(np.int64).astype(np.float64) / (BUFFER_SCALE * n)


def buffer_mask(key: bytes, count: int) -> np.ndarray:
    """The mask of ``count`` values in Z_{2^64} for a round's buffers, from the seed of the signs' mask.

    A stream apart from the signs': its key is ``SHA-256(seed ‖ "buffers")``.
    """
    stream_key = hashlib.sha256(key + b"buffers").digest()
    stream = Cipher(algorithms.ChaCha20(stream_key, bytes(16)), mode=None).encryptor().update(bytes(8 * count))
    return np.frombuffer(stream, dtype=np.uint64)
