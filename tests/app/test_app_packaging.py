"""The app extra brings what the repository app imports (the library's packaging: tests/library/test_packaging.py)."""

from __future__ import annotations

from ..library.test_packaging import NOT_DECLARED, PYPROJECT, declared, third_party_imports


def test_the_app_extra_brings_what_the_app_imports_beyond_the_library() -> None:
    # Prepare
    needed = set(third_party_imports("flower_dlion_app")) - NOT_DECLARED
    base, app = declared(PYPROJECT["dependencies"]), declared(PYPROJECT["optional-dependencies"]["app"])
    dev = declared(PYPROJECT["optional-dependencies"]["dev"])
    # Assert: the app's imports are in the library's dependencies or the `app` extra; dev installs the app too
    assert needed - base - app == set()
    assert app <= dev and declared(PYPROJECT["optional-dependencies"]["lm"]) <= dev
