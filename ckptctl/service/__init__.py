"""``watch``: the crash-safe tiering service (its passes, hops, trims and drains) and its
service parts: multi-node runs, metrics for Prometheus, systemd notification.

Imports tiering and every package below it."""
