"""The study harness: sweeps of strategy × clients × partition × seed, and their report."""
