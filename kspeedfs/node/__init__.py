"""The node daemon: server and ops, segment store, preload, read-through, spill, leases."""
