"""The library's tests: they import flower_dlion (and tests/ helpers), never flower_dlion_app."""
