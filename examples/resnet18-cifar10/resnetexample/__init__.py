"""resnetexample: ResNet-18 on CIFAR-10 with Distributed Lion (or FedAvg, to compare)."""
