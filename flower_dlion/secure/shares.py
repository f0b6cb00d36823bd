"""A node's secure-aggregation keys, and the Shamir shares of its mask key that let the server survive its dropout.

Each node holds, per *epoch* of its keys, two X25519 key pairs: the **mask key**, whose exchanges
with the other nodes' mask keys seed the pairwise masks (:mod:`.masking`), and the **share key**,
whose exchanges encrypt the shares. At setup it splits its mask key's 32 private bytes into
Shamir shares (threshold t, one per *holder*: the other nodes keyed by then; Flower's
``flwr.common.secure_aggregation.crypto.shamir``, pycryptodome's GF(2¹²⁸) sharing) and seals
each for its holder with AES-256-GCM under ``HKDF-SHA256(X25519(share keys))``, the run, the
owner, the epoch and the holder bound in as associated data. The server keeps the sealed shares;
it cannot open them. When the node drops out of a round after the others masked with it, the
server asks the surviving holders to open theirs, combines t of them (:func:`recover_mask_key`)
and checks the result against the node's public mask key. A recovered key is spent: the node
gets a new epoch before it masks again.

Imports numpy, cryptography and Flower's Shamir sharing only.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares

__all__ = ["SHARE_BYTES", "NodeKeys", "open_share", "recover_mask_key", "seal_shares", "threshold_for"]

KEY_BYTES = 32
SHARE_BYTES = 4 + 48  # flwr's share of 32 bytes: a 4-byte index and three 16-byte chunks (padded secret)
_NONCE = 12
_SHARE_INFO = b"flower-dlion share v1"


@dataclass(frozen=True)
class NodeKeys:
    """A node's two X25519 private keys of one epoch (kept by the node only)."""

    mask: X25519PrivateKey
    share: X25519PrivateKey

    @classmethod
    def generate(cls) -> NodeKeys:
        """Fresh keys from the operating system's randomness."""
        return cls(X25519PrivateKey.generate(), X25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, mask: bytes, share: bytes) -> NodeKeys:
        """Keys from their 32 raw private bytes each (ValueError for another length)."""
        return cls(X25519PrivateKey.from_private_bytes(mask), X25519PrivateKey.from_private_bytes(share))

    def private_bytes(self) -> tuple[bytes, bytes]:
        """The raw private bytes of the mask key and the share key."""
        return self.mask.private_bytes_raw(), self.share.private_bytes_raw()

    def public_bytes(self) -> tuple[bytes, bytes]:
        """The raw public bytes of the mask key and the share key (what the node advertises)."""
        return self.mask.public_key().public_bytes_raw(), self.share.public_key().public_bytes_raw()


def threshold_for(holders: int, fraction: float) -> int:
    """The shares needed to recover a mask key: t = max(2, ⌈fraction · holders⌉), at most ``holders``.

    Raises
    ------
    ValueError
        Fewer than 2 holders (one holder alone could then recover the key).

    """
    if holders < 2:
        raise ValueError(f"a mask key needs at least 2 share holders, got {holders}")
    return min(holders, max(2, math.ceil(fraction * holders)))


def _aad(run_key: str, owner: int, epoch: int, holder: int) -> bytes:
    """What a sealed share is bound to: the run, the key's owner and epoch, and the holder."""
    return f"{run_key}|{owner}|{epoch}|{holder}".encode()


def _box(private: X25519PrivateKey, public: bytes, run_key: str) -> AESGCM:
    """AES-256-GCM under HKDF-SHA256 of an X25519 exchange between two share keys."""
    shared = private.exchange(X25519PublicKey.from_public_bytes(public))
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_SHARE_INFO + run_key.encode()).derive(shared)
    return AESGCM(key)


def seal_shares(
    keys: NodeKeys, owner: int, epoch: int, holders: dict[int, bytes], threshold: int, run_key: str
) -> dict[int, bytes]:
    """Shares of ``keys.mask``, one per holder (holder → its public share key), each sealed for its holder.

    Returns holder → nonce ‖ AES-GCM(share), 12 + 52 + 16 bytes.
    """
    if not 2 <= threshold <= len(holders):
        raise ValueError(f"threshold must be in [2, {len(holders)}] (the holders), got {threshold}")
    secret = keys.mask.private_bytes_raw()
    out = {}
    for (holder, public), share in zip(
        sorted(holders.items()), create_shares(secret, threshold, len(holders)), strict=True
    ):
        nonce = os.urandom(_NONCE)
        out[holder] = nonce + _box(keys.share, public, run_key).encrypt(
            nonce, share, _aad(run_key, owner, epoch, holder)
        )
    return out


def open_share(keys: NodeKeys, owner_share_public: bytes, sealed: bytes, run_key: str, owner: int, epoch: int,
               holder: int) -> bytes:  # fmt: skip
    """The share a holder was sealed (:func:`seal_shares`), opened with its own share key.

    Raises
    ------
    ValueError
        The sealed bytes are not a share of ``owner``'s key of ``epoch`` for this holder (wrong
        length, tampered with, or sealed for another run, owner, epoch or holder).

    """
    if len(sealed) != _NONCE + SHARE_BYTES + 16:
        raise ValueError(f"a sealed share has {_NONCE + SHARE_BYTES + 16} bytes, got {len(sealed)}")
    try:
        return _box(keys.share, owner_share_public, run_key).decrypt(
            sealed[:_NONCE], sealed[_NONCE:], _aad(run_key, owner, epoch, holder)
        )
    except (InvalidTag, ValueError) as err:
        raise ValueError(f"the sealed share of node {owner}'s key (epoch {epoch}) does not open") from err


def recover_mask_key(shares: list[bytes], mask_public: bytes, threshold: int) -> X25519PrivateKey:
    """The mask key from at least ``threshold`` opened shares, checked against its public key.

    Raises
    ------
    ValueError
        Too few shares, a share of the wrong length, or shares that do not give the key whose
        public bytes are ``mask_public``.

    """
    if len(shares) < threshold:
        raise ValueError(f"{len(shares)} shares, {threshold} needed")
    if any(len(s) != SHARE_BYTES for s in shares):
        raise ValueError(f"a share has {SHARE_BYTES} bytes")
    try:
        secret = combine_shares(shares[:threshold])
        key = X25519PrivateKey.from_private_bytes(secret)
    except ValueError as err:
        raise ValueError("the shares do not combine into a key") from err
    if key.public_key().public_bytes_raw() != mask_public:
        raise ValueError("the shares combine into another key than the node advertised")
    return key
