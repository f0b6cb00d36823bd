"""The repository's own Flower app on Fashion-MNIST, its baselines and the study harness: not the library.

Built on :mod:`flower_dlion` (the library a Flower user imports) and never imported by it:

* ``server_app.py`` / ``client_app.py``: the app ``flwr run .`` starts (pyproject's components),
  with ``config/`` (every run-config key), ``data.py`` (partitions), ``model.py`` (the CNNs),
  ``results.py``, ``metering.py`` (bytes measured on the messages), ``checkpoint.py``;
* ``clients/`` and ``strategies/``: the baselines (FedAvg's local SGD client, the gradient
  baselines, SCAFFOLD) and the fault study's attackers;
* ``deploy.py`` (the Deployment Engine's processes) and ``study/`` (sweeps and reports); the
  in-process Flower Grid its tests and studies use is the library's :mod:`flower_dlion.testing`.
"""
