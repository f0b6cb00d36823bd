"""``python -m flower_dlion.config [--write]``: print the run-config table, or rewrite its generated copies."""

from .generate import main

main()
