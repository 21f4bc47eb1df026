"""RDMA transport: one-sided reads of a node's registered segment memory (pyverbs)."""
