"""pytorchexample: A Flower / PyTorch app."""
