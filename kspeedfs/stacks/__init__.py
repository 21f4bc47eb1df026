"""The cache for other Python data stacks, without FUSE: an fsspec filesystem (`kspeedfs://`)
that pyarrow, Hugging Face datasets and any fsspec user read through."""
