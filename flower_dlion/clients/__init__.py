"""Client logic of flower-dlion (ClientApp handlers)."""
