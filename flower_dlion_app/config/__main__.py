"""``python -m flower_dlion_app.config [--write]``: print the run-config table, or rewrite its generated copies."""

from flower_dlion_app.config.generate import main

main()
