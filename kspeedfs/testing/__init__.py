"""The harness of the tests, the benches and the demo: real processes on 127.0.0.1.

Not part of the product's data path: nodes, mounts, etcd and an S3 server started as
subprocesses, waited for and stopped in order, so a run leaves nothing behind.
"""
