"""Run configuration of the repository app: every key, grouped, with its default, its meaning and its check.

:data:`GROUPS` (:mod:`.keys`: algorithm, baselines, data, runtime, faults, persistence) is the one
source of the defaults. ``pyproject.toml``'s ``[tool.flwr.app.config]`` (what ``flwr run`` reads)
and the key tables of docs/APP.md are generated from it (:mod:`.generate`)::

    python -m flower_dlion_app.config --write      # rewrite both; a test fails while either is stale

:func:`read_config` (:mod:`.checks`) merges a run config over :data:`DEFAULTS` and checks every
value, so code that gets an empty run config (``run_simulation``, unit tests, the study harness)
behaves like ``flwr run``, and a bad value fails before round 1 with the key, the value and what
is allowed.
"""

from flower_dlion_app.config.checks import read_config
from flower_dlion_app.config.keys import (
    _CHOICES,
    BYZANTINE_MODES,
    DEFAULTS,
    DLION_ONLY,
    DLION_STRATEGIES,
    FEDAVG_FAMILY,
    FEDOPT,
    GROUPS,
    STRATEGIES,
    Group,
    Key,
)

__all__ = [
    "BYZANTINE_MODES",
    "DEFAULTS",
    "DLION_ONLY",
    "DLION_STRATEGIES",
    "FEDAVG_FAMILY",
    "FEDOPT",
    "GROUPS",
    "STRATEGIES",
    "_CHOICES",
    "Group",
    "Key",
    "read_config",
]
