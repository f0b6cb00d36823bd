"""Entropy coding of integer arrays (broadcast Δs and count differences) with constriction's ANS coder.

Imports numpy, zlib and `constriction <https://bamler-lab.github.io/constriction/>`_ only.
The values are split into blocks (runs of whole tensors of at least :data:`BLOCK` values) and,
optionally, by a context every decoder already holds (e.g. the last two Δs at the same
coordinate). Each (block, context) group gets its own frequency table, written in the
header, so the code adapts per tensor and per context; the symbols are coded by one
asymmetric-numeral-systems stream. Layout (little-endian)::

    "DLE1" | u32 d | u8 contexts | u16 blocks | u32 block ends[blocks]
    per (block, context): i32 lowest value, u32 symbols s, u32 frequencies[s]
    u32 words | u32 ANS words[words] | u32 CRC-32 of everything before it

A truncated, padded or corrupted payload raises :class:`CodingError`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import constriction
import numpy as np

__all__ = ["BLOCK", "CodingError", "blocks_of", "decode", "encode"]

MAGIC = b"DLE1"
BLOCK = 1 << 16  # tensors are merged into blocks of at least this many values (smaller ones share a table)
MAX_SYMBOLS = 1 << 16  # alphabet of one group: a wider range is refused (counts are bounded far below it)


class CodingError(ValueError):
    """A coded payload that does not decode: truncated, corrupted, or not made for this model."""


def blocks_of(sizes: Sequence[int]) -> list[int]:
    """Block ends: consecutive tensors merged until a block holds at least :data:`BLOCK` values."""
    ends, start, pos = [], 0, 0
    for size in sizes:
        pos += int(size)
        if pos - start >= BLOCK:
            ends.append(pos)
            start = pos
    if pos > start or not ends:
        if ends and pos - start < BLOCK:
            ends[-1] = pos  # a short tail joins the last block
        else:
            ends.append(pos)
    return ends


def _model(frequencies: np.ndarray) -> constriction.stream.model.Categorical:
    return constriction.stream.model.Categorical(frequencies.astype(np.float64), perfect=False)


def _groups(d: int, ends: list[int], context: np.ndarray | None, contexts: int):
    """(block, context, positions) of each group, in coding order."""
    start = 0
    for end in ends:
        if context is None:
            yield slice(start, end), None
        else:
            block = context[start:end]
            for c in range(contexts):
                yield slice(start, end), block == c
        start = end


def encode(values: np.ndarray, ends: Sequence[int], context: np.ndarray | None = None, contexts: int = 1) -> bytes:
    """Code the integer ``values`` (1-D) by block (``ends``, see :func:`blocks_of`) and context.

    ``context`` holds a group number in ``[0, contexts)`` per value, known to the decoder.
    """
    values = np.asarray(values).reshape(-1)
    d = values.size
    ends = [int(e) for e in ends]
    if not ends or ends[-1] != d:
        raise ValueError(f"block ends {ends[-3:]} do not end at d={d}")
    if context is not None and (context.shape != (d,) or not 1 <= contexts <= 255):
        raise ValueError(f"context of shape {context.shape} with {contexts} contexts for d={d}")
    header = [MAGIC, struct.pack("<IBH", d, contexts if context is not None else 1, len(ends))]
    header.append(np.asarray(ends, dtype="<u4").tobytes())
    coded: list[tuple[np.ndarray, np.ndarray]] = []  # (symbols, frequencies) per group with 2+ symbols
    for span, mask in _groups(d, ends, context, contexts):
        group = values[span] if mask is None else values[span][mask]
        if group.size == 0:
            header.append(struct.pack("<iI", 0, 0))
            continue
        lo, hi = int(group.min()), int(group.max())
        if hi - lo + 1 > MAX_SYMBOLS:
            raise ValueError(f"values span [{lo}, {hi}]: more than {MAX_SYMBOLS} symbols in one group")
        symbols = (group - lo).astype(np.int32)
        frequencies = np.bincount(symbols, minlength=hi - lo + 1).astype(np.uint32)
        header.append(struct.pack("<iI", lo, frequencies.size) + frequencies.astype("<u4").tobytes())
        if frequencies.size > 1:
            coded.append((symbols, frequencies))
    coder = constriction.stream.stack.AnsCoder()
    for symbols, frequencies in reversed(coded):  # a stack: the last group in is the first out
        coder.encode_reverse(symbols, _model(frequencies))
    words = coder.get_compressed().astype("<u4")
    body = b"".join(header) + struct.pack("<I", words.size) + words.tobytes()
    return body + struct.pack("<I", zlib.crc32(body))


def decode(buf: bytes, d: int, ends: Sequence[int], context: np.ndarray | None = None, contexts: int = 1) -> np.ndarray:
    """Inverse of :func:`encode`: the ``d`` values as int32 (the same ``ends`` and ``context``)."""
    buf = bytes(buf)
    if len(buf) < 4 + 7 + 8 or buf[:4] != MAGIC:
        raise CodingError(f"not a coded payload ({len(buf)} bytes, starts {buf[:4]!r})")
    if zlib.crc32(buf[:-4]) != struct.unpack_from("<I", buf, len(buf) - 4)[0]:
        raise CodingError(f"CRC-32 mismatch in a {len(buf)}-byte payload (corrupted or truncated)")
    ends = [int(e) for e in ends]
    got_d, got_contexts, num_blocks = struct.unpack_from("<IBH", buf, 4)
    want_contexts = contexts if context is not None else 1
    if (got_d, got_contexts, num_blocks) != (d, want_contexts, len(ends)):
        raise CodingError(
            f"payload is for d={got_d}, {got_contexts} contexts, {num_blocks} blocks; "
            f"expected d={d}, {want_contexts}, {len(ends)}"
        )
    pos = 11
    got_ends = np.frombuffer(buf, dtype="<u4", count=num_blocks, offset=pos).tolist()
    if got_ends != ends:
        raise CodingError("payload's blocks differ from this model's tensors")
    pos += 4 * num_blocks
    out = np.empty(d, dtype=np.int32)
    plan = []  # (span, mask, lo, frequencies)
    try:
        for span, mask in _groups(d, ends, context, contexts):
            lo, size = struct.unpack_from("<iI", buf, pos)
            pos += 8
            if size > MAX_SYMBOLS:
                raise CodingError(f"a group of {size} symbols (at most {MAX_SYMBOLS})")
            frequencies = np.frombuffer(buf, dtype="<u4", count=size, offset=pos)
            pos += 4 * size
            n = (span.stop - span.start) if mask is None else int(np.count_nonzero(mask))
            if int(frequencies.sum(dtype=np.int64)) != n:
                raise CodingError(f"a group's frequencies sum to {int(frequencies.sum())}, it has {n} values")
            plan.append((span, mask, lo, frequencies))
        (num_words,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if pos + 4 * num_words + 4 != len(buf):
            raise CodingError(f"payload has {len(buf)} bytes, its header says {pos + 4 * num_words + 4}")
        words = np.frombuffer(buf, dtype="<u4", count=num_words, offset=pos).astype(np.uint32)
    except struct.error as err:
        raise CodingError(f"truncated header: {err}") from err
    coder = constriction.stream.stack.AnsCoder(words)
    for span, mask, lo, frequencies in plan:
        n = int(frequencies.sum(dtype=np.int64))
        if n == 0:
            continue
        if frequencies.size == 1:
            symbols = np.zeros(n, dtype=np.int32)
        else:
            symbols = coder.decode(_model(frequencies), n)
        target = out[span]
        if mask is None:
            target[:] = symbols + lo
        else:
            target[mask] = symbols + lo
    if not coder.is_empty():
        raise CodingError("payload holds more coded data than its header describes")
    return out
