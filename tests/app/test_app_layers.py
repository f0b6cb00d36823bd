"""The repository app holds what is not the library (the library's layers: tests/library/test_layers.py)."""

from __future__ import annotations

from ..library.test_layers import APP, PACKAGE


def test_the_app_holds_what_is_not_the_library() -> None:
    # Assert: the app, its baselines and the harness are in flower_dlion_app/, none left in the library
    names = ["server_app.py", "client_app.py", "data.py", "model.py", "config", "results.py", "metering.py"]
    names += ["checkpoint.py", "deploy.py", "study", "clients/fedavg.py", "clients/gradient.py"]
    names += ["clients/attacks.py", "clients/common.py", "strategies/global_opt.py", "strategies/scaffold.py"]
    for name in names:
        assert (APP / name).exists() and not (PACKAGE / name).exists(), name
    # the in-process grid is the library's testing helper (flower_dlion.testing), for users' tests too
    assert (PACKAGE / "testing.py").exists() and not (APP / "local_grid.py").exists()


def test_the_baselines_wire_keys_are_the_apps() -> None:
    # Prepare
    from flower_dlion import protocol as library
    from flower_dlion_app import protocol as app

    keys = {"CONTROL": "control", "GRAD_CONFIG": "grad.config", "GRAD_MODEL": "grad.model"}
    keys |= {"GRAD_UPDATE": "grad.update", "GRAD_METRICS": "grad.metrics", "TERNGRAD_STYPE": "terngrad.v1"}
    # Assert: SCAFFOLD's and the gradient baselines' keys (same values) are the app's, none left in the library
    assert {name: getattr(app, name) for name in keys} == keys and sorted(app.__all__) == sorted(keys)
    assert not [name for name in keys if hasattr(library, name) or name in library.__all__]
