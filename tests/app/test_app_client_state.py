"""The app's run-config keys of the client's settings (the library's own checks: tests/library/test_client_state.py)."""

from __future__ import annotations

import pytest

from flower_dlion_app.config import read_config


def test_bad_client_settings_fail_in_the_run_config() -> None:
    with pytest.raises(ValueError, match=r"'max-resident' must be >= -1 \(-1: automatic, 0: none\), got -2"):
        read_config({"max-resident": -2})
    with pytest.raises(ValueError, match=r"'link-mbps' must be a finite number >= 0 \(0: unknown\), got -1.0"):
        read_config({"link-mbps": -1.0})
