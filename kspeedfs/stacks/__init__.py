"""The cache for other Python data stacks, without FUSE: an fsspec filesystem (`kspeedfs://`)
that pyarrow, Hugging Face datasets and any fsspec user read through, and a `kspeedfs` scheme
for WebDataset's own URL opener (`gopen`), registered when webdataset.gopen is imported (at
once when it is already; WebDataset imports torch, which this package does not want to)."""

from kspeedfs.stacks.gopen import register_when_imported

register_when_imported()
