"""How any torch model maps onto Distributed Lion: the flat vector x, and the rest of its state.

Imports torch only. Distributed Lion trains one flat float32 vector x: the model's trainable
parameters (``requires_grad``) in ``named_parameters()`` order, a tied parameter once. Every
other entry of the model's ``state_dict()`` is one of:

========== ================================================================================
kind       what happens to it
========== ================================================================================
trainable  a slice of x: Lion-updated on every replica, 1 bit per value up
frozen     a parameter with ``requires_grad=False`` (a LoRA run's base model, a pretrained
           backbone): named by reference, never sent. Every node and the server use their
           own copy; the hello carries its checksum (:func:`tensor_checksum`), and a node
           whose copy differs from the server's, or from the federation's, is refused
           naming the tensor, before it trains
buffer     BatchNorm's running statistics, ``num_batches_tracked``, any registered buffer:
           each client keeps its own (its forward passes update them, as in FedBN) and
           uploads them every few rounds; the server's copy, which ``evaluate_fn`` and
           ``Result.arrays`` see, is their median (:func:`flower_dlion.bounds.robust_buffers`)
alias      a second name of a parameter already listed (tied weights): the same values
========== ================================================================================

A :class:`ModelSpec` lists the entries in ``state_dict()`` order. The client sends it to the
server once (in its hello), so a server given ``ArrayRecord(model.state_dict())`` knows which
arrays are x; both sides check that the names and shapes agree before any training. The
server's arrays may leave the frozen entries out (as FlowerTune's ``get_peft_model_state_dict``
does): the first node's checksums are then the federation's reference.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

__all__ = [
    "Binding",
    "Entry",
    "LayoutError",
    "ModelSpec",
    "cross_entropy_loss",
    "layer_mask",
    "layout_fingerprint",
    "state_checksum",
    "tensor_checksum",
    "to_device",
]

Kind = Literal["trainable", "frozen", "buffer", "alias"]
KINDS: tuple[Kind, ...] = ("trainable", "frozen", "buffer", "alias")
LossFn = Callable[[nn.Module, Any], torch.Tensor]


class LayoutError(ValueError):
    """Two descriptions of a model (a client's, the server's arrays) do not match."""


@dataclass(frozen=True)
class Entry:
    """One ``state_dict()`` entry: its name, shape, torch dtype name, kind and (alias) target."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch.": "float32", "bfloat16", "int64", …
    kind: Kind
    target: str = ""  # alias: the name of the parameter it shares
    checksum: int | None = None  # frozen: tensor_checksum of the describing side's copy

    @property
    def size(self) -> int:
        """Number of values."""
        return math.prod(self.shape)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelSpec:
    """The entries of a model's ``state_dict()``, in order, each with its kind (see the module doc)."""

    entries: tuple[Entry, ...]

    @classmethod
    def from_module(cls, model: nn.Module, *, checksums: bool = True) -> ModelSpec:
        """Describe ``model``; ``checksums``: each frozen entry with its :func:`tensor_checksum`.

        Raises
        ------
        ValueError
            For a parameter that is not floating point (Lion's signs need real values), or a
            model without a trainable parameter.

        """
        first_name: dict[int, str] = {}  # id of a Parameter → its first name
        params: dict[str, nn.Parameter] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if not p.dtype.is_floating_point:
                raise ValueError(
                    f"parameter {name!r} has dtype {p.dtype}: Distributed Lion updates floating-point "
                    "parameters only (register integer state as a buffer instead)"
                )
            params[name] = p
            first_name.setdefault(id(p), name)
        buffers = dict(model.named_buffers(remove_duplicate=False))
        entries = []
        for name, value in model.state_dict(keep_vars=True).items():
            shape, dtype = tuple(int(s) for s in value.shape), _dtype_name(value.dtype)
            if name in params:
                p = params[name]
                if first_name[id(p)] != name:
                    entries.append(Entry(name, shape, dtype, "alias", first_name[id(p)]))
                else:
                    kind: Kind = "trainable" if p.requires_grad else "frozen"
                    crc = tensor_checksum(value) if kind == "frozen" and checksums else None
                    entries.append(Entry(name, shape, dtype, kind, checksum=crc))
            elif name in buffers:
                entries.append(Entry(name, shape, dtype, "buffer"))
            else:  # a state_dict() extension of the model's own: named by reference, like a frozen parameter
                crc = tensor_checksum(value) if checksums else None
                entries.append(Entry(name, shape, dtype, "frozen", checksum=crc))
        spec = cls(tuple(entries))
        if not spec.trainable:
            raise ValueError("the model has no trainable parameter (requires_grad=True): nothing for Lion to train")
        return spec

    @classmethod
    def of_arrays(cls, arrays: Mapping[str, np.ndarray]) -> ModelSpec:
        """A description of arrays whose clients sent none: every array is trainable (and must be floats)."""
        for name, a in arrays.items():
            if a.dtype.kind != "f":
                raise ValueError(
                    f"initial array {name!r} has dtype {a.dtype}: without a model description from the clients "
                    "(DLionClient sends one) every initial array is a trainable parameter, and those must be floats"
                )
        if not arrays:
            raise ValueError("initial ArrayRecord is empty")
        return cls(tuple(Entry(name, tuple(a.shape), str(a.dtype), "trainable") for name, a in arrays.items()))

    # ------------------------------------------------------------------ views
    def of_kind(self, kind: Kind) -> tuple[Entry, ...]:
        """The entries of one kind, in order."""
        return tuple(e for e in self.entries if e.kind == kind)

    @functools.cached_property
    def trainable(self) -> tuple[Entry, ...]:
        """The entries of x, in flat order."""
        return self.of_kind("trainable")

    @functools.cached_property
    def buffers(self) -> tuple[Entry, ...]:
        """The buffers, in order (uploaded as one flat float32 vector)."""
        return self.of_kind("buffer")

    @functools.cached_property
    def rest(self) -> tuple[Entry, ...]:
        """What a full model carries besides x: the buffers (frozen parameters are named by reference)."""
        return self.buffers

    @property
    def d(self) -> int:
        """Length of x."""
        return sum(e.size for e in self.trainable)

    @property
    def sizes(self) -> list[int]:
        """Values per tensor of x, in flat order."""
        return [e.size for e in self.trainable]

    @property
    def layout(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of each tensor of x."""
        return [(e.name, e.shape) for e in self.trainable]

    @property
    def num_buffer_values(self) -> int:
        """Length of the flat buffer upload."""
        return sum(e.size for e in self.buffers)

    # ------------------------------------------------------------------ on the wire
    def encode(self) -> bytes:
        """The description as compact bytes (zlib-compressed JSON), for a hello; see :meth:`decode`."""
        if any(e.kind == "frozen" and e.checksum is None for e in self.entries):
            raise ValueError("a frozen entry without its checksum: describe the model with checksums=True")
        rows = [[e.name, e.kind, e.dtype, list(e.shape), *_extra(e)] for e in self.entries]
        return zlib.compress(json.dumps(rows, separators=(",", ":")).encode(), 9)

    @classmethod
    def decode(cls, data: bytes) -> ModelSpec:
        """Inverse of :meth:`encode`; ``ValueError`` for anything malformed."""
        try:
            rows = json.loads(zlib.decompressobj().decompress(data, 1 << 24))
            entries = []
            for row in rows:
                name, kind, dtype, shape, *extra = row
                if kind == "frozen" and not extra:
                    raise ValueError(
                        f"frozen entry {name!r} comes without its checksum: the node runs a flower-dlion older "
                        "than 0.3, which sent frozen parameters instead of naming them by reference"
                    )
                ok = all(isinstance(v, str) for v in (name, kind, dtype))
                ok = ok and len(extra) == (kind in ("alias", "frozen"))
                if ok and kind == "alias":
                    ok = isinstance(extra[0], str)
                elif ok and kind == "frozen":
                    ok = isinstance(extra[0], int) and not isinstance(extra[0], bool) and 0 <= extra[0] < 1 << 32
                if not ok or kind not in KINDS or not all(isinstance(s, int) and s >= 0 for s in shape):
                    raise ValueError(f"entry {row!r}")
                target, crc = (extra[0], None) if kind == "alias" else ("", extra[0] if extra else None)
                entries.append(Entry(name, tuple(shape), dtype, kind, target, crc))
        except (TypeError, ValueError, zlib.error) as err:
            raise ValueError(f"malformed model description: {err}") from err
        spec = cls(tuple(entries))
        if not spec.trainable or len({e.name for e in entries}) != len(entries):
            raise ValueError("malformed model description: no trainable entry, or a name twice")
        known = {e.name for e in spec.trainable} | {e.name for e in spec.of_kind("frozen")}
        if any((e.kind == "alias") != bool(e.target) or (e.target and e.target not in known) for e in entries):
            raise ValueError("malformed model description: an alias without a known parameter")
        return spec

    # ------------------------------------------------------------------ checks
    def check_arrays(self, arrays: Mapping[str, np.ndarray], checksums: dict[str, int] | None = None) -> None:
        """Raise :class:`LayoutError` naming the first tensor where ``arrays`` (name → array) differ.

        Names and shapes must agree; x's arrays must be floating point. Dtypes may differ
        otherwise (Flower cannot hold bfloat16: a bfloat16 model's arrays come as float32).
        Frozen entries (and their aliases) may be left out of ``arrays``; those present must have
        this spec's checksum (their values, not only their shapes). ``checksums``: those known so far,
        by name, filled in as computed (the server reads its copy of a base once for all hellos).
        """
        known = {} if checksums is None else checksums
        names, theirs = [e.name for e in self.entries], list(arrays)
        frozen = {e.name for e in self.of_kind("frozen")}
        optional = frozen | {e.name for e in self.of_kind("alias") if e.target in frozen}
        missing = [n for n in names if n not in arrays and n not in optional]
        extra = [n for n in theirs if n not in set(names)]
        if missing or extra:
            first = missing[0] if missing else extra[0]
            where = "the model has it, the arrays do not" if missing else "the arrays have it, the model does not"
            raise LayoutError(f"tensor {first!r}: {where} (model: {len(names)} entries, arrays: {len(theirs)})")
        for e in (e for e in self.entries if e.name in arrays):
            a = arrays[e.name]
            if tuple(a.shape) != e.shape:
                raise LayoutError(f"tensor {e.name!r}: shape {tuple(a.shape)} in the arrays, {e.shape} in the model")
            if e.kind == "trainable" and np.dtype(a.dtype).kind != "f":
                raise LayoutError(f"tensor {e.name!r}: a trainable parameter, but the arrays hold {a.dtype}")
            if e.kind == "frozen" and e.checksum is not None:
                crc = known[e.name] = known.get(e.name) or tensor_checksum(a)
                if crc != e.checksum:
                    raise LayoutError(
                        f"tensor {e.name!r}: a frozen parameter (named by reference, never sent) whose values "
                        f"differ: checksum {crc:#010x} in the arrays, {e.checksum:#010x} in the model. Every node "
                        "must build the server's frozen weights (load them from one file, or seed them alike: "
                        "torch.manual_seed before building them; docs/USER_GUIDE.md#your-model)"
                    )

    def check_same(self, other: ModelSpec, *, theirs: str, ours: str) -> None:
        """Raise :class:`LayoutError` naming the first entry where ``other`` differs from this spec."""
        for a, b in zip(self.entries, other.entries, strict=False):
            if a != b:
                raise LayoutError(f"tensor {a.name!r}: {_describe(b)} on {theirs}, {_describe(a)} on {ours}")
        if len(self.entries) != len(other.entries):
            longer, who = (self, ours) if len(self.entries) > len(other.entries) else (other, theirs)
            extra = longer.entries[min(len(self.entries), len(other.entries))]
            raise LayoutError(f"tensor {extra.name!r}: only on {who}")


def _describe(e: Entry) -> str:
    alias = f" of {e.target!r}" if e.target else ""
    crc = f" checksum {e.checksum:#010x}" if e.checksum is not None else ""
    return f"{e.name!r} {e.kind}{alias} {e.dtype} {e.shape}{crc}"


def _extra(e: Entry) -> list[str | int]:
    """What an entry's row carries after its shape: an alias's target, a frozen entry's checksum."""
    if e.kind == "alias":
        return [e.target]
    return [int(e.checksum)] if e.kind == "frozen" and e.checksum is not None else []


def tensor_checksum(value: torch.Tensor | np.ndarray) -> int:
    """CRC-32 of a tensor's values as float32 (floating point) or int64 (any other dtype), C order.

    The same whatever dtype carries the values (a bfloat16 tensor and the float32 array Flower
    carries it as agree), computed a slice at a time: a base of billions needs no second copy.
    """
    step, crc = 1 << 22, 0
    if isinstance(value, np.ndarray):  # Flower's arrays (often read-only buffers): numpy alone
        flat, cast = value.reshape(-1), np.float32 if value.dtype.kind == "f" else np.int64
        parts = (np.ascontiguousarray(flat[i : i + step], dtype=cast) for i in range(0, flat.size, step))
    else:
        t = value.detach().reshape(-1)
        kind = torch.float32 if t.dtype.is_floating_point else torch.int64
        parts = (t[i : i + step].to("cpu", kind).contiguous().numpy() for i in range(0, t.numel(), step))
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def layout_fingerprint(names_and_shapes: Iterable[tuple[str, Sequence[int]]]) -> str:
    """A short fingerprint of parameter names, shapes and their order (sha256 prefix)."""
    desc = ";".join(f"{name}:{tuple(int(s) for s in shape)}" for name, shape in names_and_shapes)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def layer_mask(names_and_shapes: Iterable[tuple[str, Sequence[int]]], prefixes: Sequence[str]) -> torch.Tensor:
    """Boolean mask over the flat parameters: True for tensors whose name starts with a prefix.

    An empty ``prefixes`` selects every parameter.
    """
    parts = [
        torch.full((math.prod(int(s) for s in shape),), not prefixes or name.startswith(tuple(prefixes)))
        for name, shape in names_and_shapes
    ]
    return torch.cat(parts)


def state_checksum(x: torch.Tensor | np.ndarray, rest: Mapping[str, torch.Tensor | np.ndarray] | None = None) -> int:
    """CRC-32 of x's float32 bytes, continued over each array of ``rest`` in order.

    Without ``rest`` this is the replica checksum every reply carries.
    """
    crc = zlib.crc32(np.ascontiguousarray(_host(x), dtype=np.float32))
    for value in (rest or {}).values():
        crc = zlib.crc32(np.ascontiguousarray(_host(value)).view(np.uint8), crc)
    return crc


def _host(a: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a
    a = a.detach().cpu()
    return (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).numpy()


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor in it (also inside tuples, lists and dicts) moved to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, (tuple, list)):
        moved = [to_device(v, device) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def cross_entropy_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default loss: ``cross_entropy(model(inputs), targets)`` for a batch ``(inputs, targets)``."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise TypeError(
            f"the default loss takes batches (inputs, targets); got a {type(batch).__name__}: "
            "pass loss_fn=lambda model, batch: ... to DLionClient (e.g. for dict batches)"
        )
    inputs, targets = batch
    return nn.functional.cross_entropy(model(inputs), targets)


class Binding:
    """A model object bound to its :class:`ModelSpec`: loads x and the rest into it, takes gradients at x.

    Parameters
    ----------
    model : nn.Module
        The model, on the device the client computes on.

    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.spec = ModelSpec.from_module(model, checksums=False)  # the frozen entries' values: described()
        tensors = model.state_dict(keep_vars=True)
        self._params = [tensors[e.name] for e in self.spec.trainable]
        self._rest = {e.name: tensors[e.name] for e in self.spec.rest}
        self.device = self._params[0].device
        self._loaded: tuple[object, list[int]] | None = None  # the key of the x loaded, its parameters' versions

    def flat_parameters(self) -> torch.Tensor:
        """X as the model holds it now: a flat float32 copy."""
        return torch.cat([p.detach().reshape(-1).float() for p in self._params])

    @functools.cached_property
    def described(self) -> ModelSpec:
        """The spec with each frozen entry's checksum, as the hello carries it (computed once)."""
        return ModelSpec.from_module(self.model)

    def rest(self) -> dict[str, torch.Tensor]:
        """Copies of the buffers, in order."""
        return {name: t.detach().clone() for name, t in self._rest.items()}

    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers as the model holds them now (not copies)."""
        return {e.name: self._rest[e.name].detach() for e in self.spec.buffers}

    def load_x_(self, x: torch.Tensor, key: object = None) -> None:
        """Copy the flat vector x into the trainable parameters (cast to each one's dtype).

        ``key``: what x is (e.g. a replica's version and checksum); the copy is skipped when the
        parameters hold that x already and nothing has changed them in place since (their
        version counters): nodes that train at one version in one process copy it once.
        """
        if x.numel() != self.spec.d:
            raise ValueError(f"flat vector has {x.numel()} values, the model has {self.spec.d} trainable")
        if key is not None and self._loaded is not None and self._loaded[0] == key:
            if [p._version for p in self._params] == self._loaded[1]:
                return
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                p.copy_(x[offset : offset + n].view(p.shape))
                offset += n
        self._loaded = None if key is None else (key, [p._version for p in self._params])

    def load_rest_(self, rest: Mapping[str, torch.Tensor]) -> None:
        """Copy buffers into the model (names of ``rest`` only)."""
        with torch.no_grad():
            for name, value in rest.items():
                self._rest[name].copy_(value)

    def gradient(
        self, x: torch.Tensor, loss_fn: LossFn, batch: Any, out: torch.Tensor | None = None, key: object = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Loss at x on one batch and its gradient as one flat float32 vector (x's layout).

        A parameter the loss does not reach gets a zero gradient. The batch is moved to the
        model's device first. ``out``: a float32 buffer of length d to write the gradient into
        (a fresh vector per step costs page faults on the CPU at millions of values); ``key``:
        see :meth:`load_x_`.
        """
        self.load_x_(x, key)
        loss = loss_fn(self.model, to_device(batch, self.device))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
        grads = torch.autograd.grad(loss, self._params, allow_unused=True)
        flat = [
            (torch.zeros(p.numel(), device=p.device) if g is None else g.reshape(-1).float())
            for p, g in zip(self._params, grads, strict=True)
        ]
        return loss.detach().float(), torch.cat(flat) if out is None else torch.cat(flat, out=out)
