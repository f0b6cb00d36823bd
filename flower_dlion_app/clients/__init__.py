"""The repository app's clients besides DLionClient: FedAvg's local SGD, the gradient baselines, the attackers."""
