"""What operators use: the inventory of a lock store, the lock page and the Prometheus exporter."""
