"""kspeedfs: a dataset cache for deep-learning training, served over FUSE and a fast path."""

__version__ = "0.1.0"
