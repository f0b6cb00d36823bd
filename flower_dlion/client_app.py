"""ClientApp entry point: the Distributed Lion client (see ``clients/dlion.py``)."""

from flwr.clientapp import ClientApp

from .clients.dlion import train

app = ClientApp()
app.train()(train)
