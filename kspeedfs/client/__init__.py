"""Reading a cluster's datasets: the one read policy, transports per node, preload and wait."""
