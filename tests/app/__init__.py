"""The repository app's tests (flower_dlion_app: its app, baselines, study harness and data)."""
