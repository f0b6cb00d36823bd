"""The user guide's "Testing your app in process" example, run as written: LocalGrid from the library alone."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _example() -> str:
    """The Python block under the user guide's "Testing your app in process" heading."""
    guide = (ROOT / "docs" / "USER_GUIDE.md").read_text()
    section = guide.split("## Testing your app in process", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


def test_the_user_guides_in_process_test_runs_and_imports_only_the_library() -> None:
    # Prepare: the example, in a namespace of its own
    code, scope = _example(), {"__name__": "users_test"}
    before = {m for m in sys.modules if m.startswith("flower_dlion_app")}
    # Execute: define the app, then run its test function
    exec(compile(code, "USER_GUIDE.md", "exec"), scope)
    scope["test_three_rounds_of_my_app"]()
    # Assert: it needs nothing of the repository's app
    assert "flower_dlion_app" not in code
    assert {m for m in sys.modules if m.startswith("flower_dlion_app")} == before
