"""Issue 48: a client's state on its device and on the host.

* the host/device boundary: host code takes numpy arrays only, and nothing in the client moves
  an array across but ``clients/placement.py`` (the bug class of GPU clients that failed from
  round 2: a device tensor reaching host code);
* state resident on the device between messages, replicas shared by the nodes at one version,
  checked against the persisted copy, which a new process starts from: both paths train the
  same run bit for bit;
* a persisted state that is damaged, non-finite or another run's is refused with the node, the
  copy and the reason, and the node resyncs; the device running out of memory says what to set.
"""

from __future__ import annotations

import ast
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader

import flower_dlion
from flower_dlion import DistributedLion, DLionClient, accel, anchored_counts, codec, entropy
from flower_dlion.clients.link import REPROBE, ContextChoice, DecodeCost
from flower_dlion.clients.placement import Placement
from flower_dlion.clients.state import ClientStateError, Expected, HostState, StateRefused, check_state, crc32
from flower_dlion.clients.state_store import StateStore
from flower_dlion.lion import anchored
from flower_dlion.testing import LocalGrid

from .. import byom
from ..byom import ByomNet
from ..states import load, save_state
from .test_codec import MODES

CPU = torch.device("cpu")


def on_device(client: DLionClient) -> Any:
    """The one device ``client`` trained on (CUDA on a GPU machine, the CPU here): its replicas and residents."""
    (only,) = client._devices.values()
    return only


CLIENTS = Path(flower_dlion.__file__).parent / "clients"


def byom_app(**settings: object) -> tuple[ClientApp, DLionClient]:
    """A user's ClientApp on the test model (406,794 parameters, BatchNorm, frozen and tied weights)."""
    app = ClientApp()
    client = DLionClient(app, ByomNet, **settings)  # type: ignore[arg-type]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config.get("partition-id", context.node_id)) % 4
        return client.train(msg, context, DataLoader(byom.partition(pid, 4), batch_size=32, shuffle=True))

    return app, client


def run(app: ClientApp, rounds: int, nodes: int = 3, **strategy: object) -> tuple[DistributedLion, LocalGrid]:
    grid = LocalGrid(app, nodes)
    s = DistributedLion(lr=1e-3, **strategy)  # type: ignore[arg-type]
    torch.manual_seed(0)
    s.start(grid, ArrayRecord(ByomNet().state_dict()), num_rounds=rounds)
    return s, grid


# ---------------------------------------------------------------- the host/device boundary
def _crossings(path: Path) -> list[str]:
    """Calls in ``path`` that move a tensor between host and device: .cpu(), .cuda(), .to(<a device>), map_location."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else ""
        args = [ast.unparse(a) for a in node.args] + [ast.unparse(k) for k in node.keywords]
        if name in ("cpu", "cuda", "pin_memory") or any("map_location" in a for a in args):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif name == "to" and any("device" in a for a in args):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def _dlion_client_modules() -> list[Path]:
    """clients/dlion.py and every module of clients/ it imports, directly or not (not the baselines' clients)."""
    todo, seen = [CLIENTS / "dlion.py"], set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                todo.append(CLIENTS / f"{node.module}.py")
    return sorted(seen)


def test_only_placement_moves_arrays_between_host_and_device() -> None:
    # Execute: the D-Lion client's modules
    found = {p.name: _crossings(p) for p in _dlion_client_modules()}
    assert {"dlion.py", "state.py", "replica.py", "resident.py", "placement.py", "local_work.py"} <= set(found)
    # Assert: the crossings are in placement.py, and nowhere else
    assert found["placement.py"], "placement.py moves arrays: the test would see it"
    assert [c for name, calls in found.items() if name != "placement.py" for c in calls] == []


def test_host_code_takes_numpy_arrays_only_as_it_would_on_a_gpu() -> None:
    # Prepare: a state whose momentum is still a tensor (on a GPU a CUDA tensor: .numpy() would fail)
    d = 8
    x = np.linspace(-1, 1, d, dtype=np.float32)
    host = HostState(1, 1, crc32(x), torch.zeros(d), x=x)  # type: ignore[arg-type]
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    expect = Expected(d, "", "", {})
    # Execute / Assert: refused on the CPU too, naming the array and the one place to convert it
    with pytest.raises(TypeError, match=r"m is a Tensor, not a host numpy array: convert it in clients.placement"):
        StateStore(ctx, in_context=True, folder=None, as_of=-1, keep_round=0).save(host)
    with pytest.raises(TypeError, match=r"m is a Tensor, not a host numpy array"):
        check_state(host, expect)
    host.m = np.zeros(d, np.float32)
    check_state(host, expect)  # numpy: fine


def test_placement_is_views_on_the_cpu_and_rounds_bfloat16_momentum_once() -> None:
    # Prepare
    place = Placement(CPU)
    a = np.arange(6, dtype=np.float32)
    # Execute / Assert: to the device and back without a copy on the CPU
    t = place.to_device(a)
    t[0] = 7.0
    assert a[0] == 7.0 and np.shares_memory(place.to_host(t), a)
    bits = place.to_host(torch.tensor([1.0, -2.5], dtype=torch.bfloat16))
    assert bits.dtype == np.uint16 and bits.tolist() == [0x3F80, 0xC020]  # bfloat16's 16 bits
    with pytest.raises(TypeError, match="host numpy array"):
        place.to_device(torch.zeros(2))  # type: ignore[arg-type]


# ---------------------------------------------------------------- resident and persisted
@pytest.mark.parametrize("in_context", [True, False])
def test_a_process_per_message_trains_exactly_like_state_kept_on_the_device(tmp_path: Path, in_context: bool) -> None:
    # Prepare: the same federation twice: state kept on the device between messages (the default), and none kept
    # (every message starts from the persisted copy, as a Deployment Engine ClientApp in a new process does)
    results = []
    for max_resident in (None, 0):
        app, client = byom_app(state_in_context=in_context, state_dir=str(tmp_path / str(max_resident)),
                               max_resident=max_resident)  # fmt: skip
        # Execute: partial participation (catch-ups), 6 rounds
        strategy, grid = run(app, 6, nodes=4, fraction_train=0.75, sample_seed=3)
        client.wait()
        here = on_device(client)
        results.append((strategy, grid, here))
    # Assert: the same model bit for bit, every reply valid, no resync; the default kept the nodes resident
    (s_res, _, resident), (s_new, _, none) = results
    assert torch.equal(s_res.x, s_new.x)
    for s in (s_res, s_new):
        assert all(h["num-rejected"] == 0 and h["checksum-mismatches"] == 0 for h in s.history)
        assert sum(h["catch-ups"] for h in s.history) > 0 and sum(h["state-resets"] for h in s.history) == 0
    assert [h["full-syncs"] for h in s_res.history] == [h["full-syncs"] for h in s_new.history]
    assert len(resident.residents) == 4 and len(none.residents) == 0


def test_nodes_at_one_version_share_one_replica_and_keep_only_their_momentum() -> None:
    # Prepare: 6 virtual nodes in one process
    app, client = byom_app(state_in_context=True)
    # Execute
    strategy, _ = run(app, 3, nodes=6)
    # Assert: one replica a version made once (5 of 6 nodes found it made), at most the two newest kept;
    # per node its momentum (4 bytes a value) and the undo of its last Δ (its packed trits, 1.6 bits)
    here = on_device(client)
    d = strategy.num_parameters
    assert len(here.residents) == 6 and len(here.pool) <= 2
    assert here.pool.hits >= 2 * 5
    model = ByomNet().state_dict()
    rest = sum(model[e.name].numel() * model[e.name].element_size() for e in strategy.spec.rest)
    assert here.residents.nbytes() <= 6 * (4 * d + (d + 4) // 5 + 2 + rest)
    assert here.residents.nbytes() / (6 * d) < 5  # bytes per parameter per virtual node


def test_a_resident_state_yields_to_its_persisted_copy_when_they_disagree(caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: 2 rounds; then node 1000's persisted copy is replaced by an older one (another process wrote it)
    app, _ = byom_app(state_in_context=True)
    strategy, grid = run(app, 2, nodes=2)
    ctx = grid.context(1000)
    host = load(ctx).host
    save_state(ctx, host)  # the same state, written anew: a new stamp
    grid.set_context(1000, ctx)
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    # Execute
    _go_on(strategy, grid, range(3, 5))
    # Assert: said once (node, copy), and the run went on from the persisted copy without a resync
    said = [r.message for r in caplog.records if "the persisted copy wins" in r.message]
    assert len(said) == 1 and "node 1000: its state on the device is not its persisted copy (context.state" in said[0]
    assert all(h["num-replies"] == 2 and h["full-syncs"] == 0 for h in strategy.history[2:])


def test_files_are_written_after_the_reply_and_a_reader_waits_for_them(tmp_path: Path) -> None:
    # Prepare: a node's file of round 1, and a write of round 2 still under way (its marker is there)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    x = np.linspace(-1, 1, 10, dtype=np.float32)
    store = StateStore(ctx, in_context=False, folder=tmp_path, as_of=-1, keep_round=0)
    store.save(HostState(1, 1, crc32(x), np.zeros(10, np.float32), x=x))
    marker = tmp_path / ".r2.pending.1"  # pid 1 (init) is alive: another process writing round 2
    marker.touch()

    def finish() -> None:
        time.sleep(0.3)
        store.save(HostState(2, 2, crc32(x), np.ones(10, np.float32), x=x))
        marker.unlink()

    writer = threading.Thread(target=finish)
    writer.start()
    # Execute
    t0 = time.monotonic()
    current = store.current()
    writer.join()
    # Assert: the reader waited for round 2 rather than starting from round 1
    assert current is not None and current[0] == 2 and time.monotonic() - t0 >= 0.25


def test_state_files_alternate_two_slots_and_keep_the_checkpoints_round(tmp_path: Path) -> None:
    # Prepare: a partition's folder, and the rounds its client trains in with the server's keep-round
    x = np.zeros(3, np.float32)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    kept = []
    # Execute: rounds 1–3 before any checkpoint, a checkpoint after round 3, one after round 5,
    # then a resume from round 5's checkpoint that trains round 6 again
    for rnd, keep in ((1, 0), (2, 0), (3, 0), (4, 3), (5, 3), (6, 5), (7, 5), (6, 5)):
        state = HostState(rnd, rnd, crc32(x), np.full(3, rnd, np.float32), x=x)
        _, pending = StateStore(ctx, in_context=False, folder=tmp_path, as_of=-1, keep_round=keep).save(
            state, background=rnd % 2 == 0
        )
        if pending is not None:
            pending.result()
        kept.append(sorted((p.name, rounds_in_file(p)) for p in tmp_path.iterdir()))
    # Assert: the two slots take turns (never over the newest), the checkpoint's round leaves them for a file of
    # its own, older kept rounds and the dead future (round 7, after resuming at 5) go; no marker is left
    assert kept == [
        [("slot-0.state", 1)],
        [("slot-0.state", 1), ("slot-1.state", 2)],
        [("slot-0.state", 3), ("slot-1.state", 2)],
        [("r3.state", 3), ("slot-0.state", 4), ("slot-1.state", 2)],
        [("r3.state", 3), ("slot-0.state", 4), ("slot-1.state", 5)],
        [("r5.state", 5), ("slot-0.state", 4), ("slot-1.state", 6)],
        [("r5.state", 5), ("slot-0.state", 7), ("slot-1.state", 6)],
        [("r5.state", 5), ("slot-1.state", 6)],  # the dead future (rounds 6 and 7 of the first run) is gone
    ]
    # a resumed run asks for round 5: it gets the checkpoint's state
    resumed = StateStore(ctx, in_context=False, folder=tmp_path, as_of=5, keep_round=5)
    host = resumed.load(Expected(3, "", "", {}), 1)
    assert host is not None and host.round == 5 and host.m.tolist() == [5.0, 5.0, 5.0]


def rounds_in_file(path: Path) -> int:
    from flower_dlion.clients.state_store import read_state_header

    return int((read_state_header(path) or {"round": -1})["round"])


def test_a_write_cut_short_leaves_the_round_before(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Prepare: rounds 1 and 2 written; round 3 goes over slot 0 (round 1's) and is cut short half-way
    x = np.zeros(1000, np.float32)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    for rnd in (1, 2, 3):
        StateStore(ctx, in_context=False, folder=tmp_path, as_of=-1, keep_round=0).save(
            HostState(rnd, rnd, crc32(x), np.full(1000, rnd, np.float32), x=x)
        )
    slot = tmp_path / "slot-0.state"
    slot.write_bytes(slot.read_bytes()[:2000])
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    # Execute
    host = StateStore(ctx, in_context=False, folder=tmp_path, as_of=-1, keep_round=0).load(
        Expected(1000, "", "", {}), 7
    )
    # Assert: round 3's file refused, named, put aside; round 2's state instead
    assert host is not None and host.round == 2
    assert f"node 7: its state in {slot} is refused: CRC-32 mismatch" in caplog.text
    assert (tmp_path / "slot-0.state.refused").exists()


# ---------------------------------------------------------------- bad input
def newest_file_by_name(folder: Path) -> Path:
    """Round 2's slot (slot-1: the slots fill in order)."""
    return folder / "slot-1.state"


def _files_run(tmp_path: Path, rounds: int) -> tuple[DistributedLion, LocalGrid, DLionClient]:
    app, client = byom_app(state_in_context=False, state_dir=str(tmp_path))
    strategy, grid = run(app, rounds, nodes=2)
    client.wait()
    return strategy, grid, client


def _go_on(strategy: DistributedLion, grid: LocalGrid, rounds: range) -> None:
    for rnd in rounds:
        msgs = strategy.configure_train(rnd, ArrayRecord(), ConfigRecord(), grid)
        strategy.aggregate_train(rnd, grid.send_and_receive(msgs))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "CRC-32 mismatch"),
        (lambda p: p.write_bytes(b"junk"), "not a state file of format 2"),
    ],
)
def test_a_damaged_state_file_is_refused_named_and_the_node_resyncs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, reason: str
) -> None:
    # Prepare: 2 rounds with state files; then partition 0's file is damaged and its process restarts
    strategy, grid, client = _files_run(tmp_path, 2)
    folder = tmp_path / strategy.run_key / "partition-0"
    for path in folder.glob("*.state"):  # both slots (rounds 1 and 2): nothing to fall back to
        damage(path)
    path = newest_file_by_name(folder)
    on_device(client).residents.drop(f"{strategy.run_key}/partition-0")  # a new process: nothing on the device
    caplog.set_level(logging.WARNING, logger="flwr")
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    # Execute
    _go_on(strategy, grid, range(3, 6))
    # Assert: named (node, file, reason), the file put aside; one round without its reply, then in again
    said = [r.message for r in caplog.records if "is refused" in r.message]
    assert said and f"node 1000: its state in {path} is refused: {reason}" in said[0]
    assert len(list(folder.glob("*.refused"))) == 2
    assert [h["num-replies"] for h in strategy.history[2:]] == [1, 2, 2]
    assert strategy.history[3]["full-syncs"] == 1


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h: h.m.__setitem__(3, np.nan), "the momentum m has non-finite values"),
        (lambda h: setattr(h, "owner", "run-9/partition-0"), "it belongs to 'run-9/partition-0', not '"),
        (lambda h: setattr(h, "layout", "0123456789abcdef"), "it was saved for model layout 0123456789abcdef"),
        (lambda h: h.counts.__setitem__(0, h.counts[0] + 1), "x's checksum is"),
        (lambda h: setattr(h, "version", -4), "version -4"),
    ],
)
def test_a_poisoned_state_in_the_context_is_refused_and_the_node_resyncs(
    caplog: pytest.LogCaptureFixture, change, reason: str
) -> None:
    # Prepare: 2 rounds; then node 1000's context holds a changed state, read by a new process (nothing held)
    app, client = byom_app(state_in_context=True)
    strategy, grid = run(app, 2, nodes=2)
    ctx = grid.context(1000)
    host = load(ctx).host
    host.x = None
    change(host)
    save_state(ctx, host)
    grid.set_context(1000, ctx)
    client._devices.clear()  # a process that holds the replica would use its own x, never the changed counts
    caplog.set_level(logging.WARNING, logger="flwr")
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    # Execute
    _go_on(strategy, grid, range(3, 6))
    # Assert
    said = [r.message for r in caplog.records if "is refused" in r.message]
    assert said and f"node 1000: its state in context.state is refused: {reason}" in said[0]
    assert [h["num-replies"] for h in strategy.history[2:]] == [1, 2, 2]


def test_running_out_of_device_memory_names_the_model_size_and_what_to_set(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Prepare: the gradient step runs out of memory on node 1000 in round 2
    from flower_dlion.params import Binding

    gradient = Binding.gradient

    def short_of_memory(self, x, loss_fn, batch, out=None, key=None):
        if calls.append(1) or len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return gradient(self, x, loss_fn, batch, out, key)

    calls: list[int] = []
    monkeypatch.setattr(Binding, "gradient", short_of_memory)
    app, _ = byom_app(state_in_context=True)
    caplog.set_level(logging.WARNING, logger="flwr")
    caplog.set_level(logging.WARNING, logger="flower_dlion")
    # Execute
    strategy, _ = run(app, 3, nodes=2)
    # Assert: an error reply that says how large the model is and what to set; the node is back in round 3
    said = [r.getMessage() for r in caplog.records if "ran out of memory" in r.getMessage()]
    assert said and "node 1000" in said[0] and "a model of 406,794 trainable values" in said[0]
    assert "set DLionClient(max_resident=...) lower" in said[0] and "client-resources-num-gpus" in said[0]
    assert [h["num-replies"] for h in strategy.history] == [2, 1, 2]
    assert strategy.history[2]["full-syncs"] == 0


def test_bad_client_settings_fail_at_construction() -> None:
    with pytest.raises(ValueError, match=r"max_resident must be an int >= 0 or None \(auto\), got -1"):
        DLionClient(None, ByomNet, max_resident=-1)
    with pytest.raises(ValueError, match=r"link_mbps must be a finite number > 0 \(Mbit/s\) or None, got 0"):
        DLionClient(None, ByomNet, link_mbps=0)


# ---------------------------------------------------------------- the downlink's one Δ
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_levels", [2, 3])
def test_one_packed_delta_gives_the_anchored_form_bit_for_bit(
    num_levels: int, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: an anchor, counts, and a Δ's levels; the fused kernel ("on") or the torch composition
    monkeypatch.setenv(accel.KERNELS_ENV, mode)
    g = torch.Generator().manual_seed(num_levels)
    d = 4099 if num_levels == 3 else 4093  # partial last bytes
    anchor = torch.randn(d, generator=g)
    counts = torch.randint(-50, 50, (d,), generator=g, dtype=torch.int32)
    levels = torch.randint(0, num_levels, (d,), generator=g, dtype=torch.int32)
    packed = codec.encode_levels(levels, num_levels)
    signs = anchored_counts.levels_to_signs(levels, num_levels)
    # Execute: fresh outputs, and into buffers (the client's recycled ones)
    got = anchored_counts.step_counts(anchor, counts, packed, num_levels, 0.9973, 3e-4)
    buffers = (torch.full((d,), 7, dtype=torch.int32), torch.full((d,), 7.0))
    into = anchored_counts.step_counts(
        anchor, counts, packed, num_levels, 0.9973, 3e-4, out=buffers, scratch=torch.empty(d)
    )
    # Assert: C + L and lion.anchored of it, the same bits; the inputs untouched
    want = anchored(anchor, counts + signs, 0.9973, 3e-4)
    for c, x in (got, into):
        assert torch.equal(c, counts + signs) and x.numpy().tobytes() == want.numpy().tobytes()
    assert into[0] is buffers[0] and into[1] is buffers[1]
    bad = packed.clone()
    bad[3] = 250
    if num_levels == 3:
        with pytest.raises(ValueError, match="trit5 byte above 242"):
            anchored_counts.step_counts(anchor, counts, bad, 3, 0.9973, 3e-4)


def test_a_single_delta_segment_is_the_packed_delta_and_applies_like_its_code() -> None:
    # Prepare: a server history of 4 rounds
    d, ends = 3000, entropy.blocks_of([1000, 2000])
    h = anchored_counts.AnchoredHistory(torch.linspace(-1, 1, d), 0.995, 0.01, 100, ends, 1 << 30)
    for t in range(4):
        levels = torch.randint(0, 3, (d,), generator=torch.Generator().manual_seed(t), dtype=torch.int32)
        h.apply_levels(levels, 3, codec.encode_levels(levels, 3).numpy().tobytes())
    replica = anchored_counts.AnchoredForm(h.anchor.clone(), 0, torch.from_numpy(h.counts_at(3)), 3)
    # Execute
    (packed,) = h.segments(3)
    coded = h._segment(h.counts.numpy() - h.counts_at(3), h.epoch, 4, False, False, since=2)  # as if two Δs
    # Assert: the packed Δ is the server's own (levels 3, 1.6 bits a value), and both give the server's x
    assert packed.levels == 3 and packed.payload == h.deltas[4][1] and len(packed.payload) == (d + 4) // 5
    assert coded.levels == 0
    for seg in (packed, coded):
        _, x = anchored_counts.apply_segments(replica, [seg], ends, 100)
        assert x.numpy().tobytes() == h.x().numpy().tobytes()


def test_the_context_coding_is_asked_for_while_it_saves_time_on_the_link() -> None:
    # Prepare: a context-coded Δ applied at 10 ns a value that saved 0.05 bytes a value
    cost = DecodeCost(seconds_per_value=1e-8, saved_per_value=0.05)
    fast, slow, unknown = ContextChoice(100.0, cost), ContextChoice(10.0, cost), ContextChoice(None, cost)
    # Assert: 0.05·8 bits take 40 ns at 10 Mbit/s (worth 10 ns of decode) and 4 ns at 100 Mbit/s (not)
    assert slow.wanted() and slow.keeps
    assert not unknown.wanted() and not unknown.keeps
    answers = [fast.wanted() for _ in range(REPROBE)]
    assert answers == [False] * (REPROBE - 1) + [True]  # measured again every REPROBE rounds
    # not measured yet: a node with a link tries it once
    assert ContextChoice(100.0, DecodeCost()).wanted()


def test_counts_are_stored_in_the_narrowest_integer() -> None:
    from flower_dlion.clients.state import narrow_counts

    assert narrow_counts(np.array([-128, 127], np.int32)).dtype == np.int8
    assert narrow_counts(np.array([-129, 5], np.int32)).dtype == np.int16
    assert narrow_counts(np.array([40_000], np.int32)).dtype == np.int32
    with pytest.raises(StateRefused):
        HostState.from_parts({"format": 1}, {}, {}, None, b"")
    assert ClientStateError  # the client's error type is re-exported
