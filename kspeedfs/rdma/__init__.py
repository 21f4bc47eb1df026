"""RDMA transport: one-sided reads of a node's registered segment memory (pyverbs).

Not yet run on RDMA hardware or Soft-RoCE: it was written on a machine with neither. What runs
without a device (encoding, registration life cycle, negotiation and TCP fallback, fork
safety) is tested; tests/system/test_rdma_device.py holds the device tests, skipped without one.
"""
