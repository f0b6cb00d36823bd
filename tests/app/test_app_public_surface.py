"""The run's byte totals by the app's meter (library side: tests/library/test_public_surface.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from flwr.app import ArrayRecord, MessageType

from flower_dlion import DistributedLion
from flower_dlion.strategies.run_loop import DLionResult
from flower_dlion.testing import LocalGrid
from flower_dlion_app.metering import MeteredGrid

from ..byom import ByomNet
from ..library.test_client_state import byom_app


# ---------------------------------------------------------------- 1. the run's totals
def test_start_returns_the_runs_byte_totals_and_logs_them_in_one_closing_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Prepare: the user's model (BatchNorm, frozen and tied weights), 3 nodes, on a metered grid
    app, _ = byom_app()
    metered = MeteredGrid(LocalGrid(app, 3))
    strategy = DistributedLion(lr=1e-3)
    torch.manual_seed(0)
    initial = ArrayRecord(ByomNet().state_dict())
    caplog.set_level(logging.INFO, logger="flwr")
    # Execute
    result = strategy.start(metered, initial, num_rounds=3)
    # Assert: the totals are the sums of the rounds' metrics, as the history and the Result hold them …
    assert isinstance(result, DLionResult)
    totals, rows = dict(result.totals), strategy.history
    keys = ("bytes-up", "bytes-down", "bytes-up-fp32", "bytes-down-fp32")
    summed = {key: sum(int(r[key]) for r in rows) for key in keys}
    assert totals == {
        "rounds": 3,
        "rounds-applied": 3,
        "num-replies": 9,
        "num-rejected": 0,
        "num-failed": 0,
        **summed,
        "fp32-over-sent-up": summed["bytes-up-fp32"] / summed["bytes-up"],
        "fp32-over-sent-down": summed["bytes-down-fp32"] / summed["bytes-down"],
    }
    for key in summed:
        assert sum(int(m[key]) for m in result.train_metrics_clientapp.values()) == totals[key]
    # … and the bytes of every train message and reply, as measured on the grid
    train = [e for e in metered.exchanges if e.message_type == MessageType.TRAIN]
    assert (sum(e.bytes_up for e in train), sum(e.bytes_down for e in train)) == (
        totals["bytes-up"],
        totals["bytes-down"],
    )
    assert totals["fp32-over-sent-up"] > 31  # a sign per parameter: 1/32 of float32, plus the metrics
    # the closing line is the last one logged, and the printed Result shows the totals
    up, down = totals["bytes-up"] / 1e6, totals["bytes-down"] / 1e6
    up32, down32 = totals["bytes-up-fp32"] / 1e6, totals["bytes-down-fp32"] / 1e6
    expected = (
        f"[flower-dlion] run totals (result.totals): 3 rounds, 9 replies: {up:.2f} MB up, {down:.2f} MB down "
        f"(fp32 would have been {up32:.2f} / {down32:.2f} MB: {totals['fp32-over-sent-up']:.1f}× / "
        f"{totals['fp32-over-sent-down']:.1f}× fewer)"
    )
    assert caplog.records[-1].getMessage() == expected
    printed = "Run totals (result.totals):\n{ 'rounds': '3',\n  'rounds-applied': '3',\n  'num-replies': '9',"
    assert printed in str(result)
