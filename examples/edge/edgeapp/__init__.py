"""edgeapp: Distributed Lion on devices that each hold their own data."""
