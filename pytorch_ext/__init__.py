"""The PyTorch fast path: datasets that read the cache's shared memory directly, no FUSE hop."""

from .array import KSpeedDataset
from .external_source import KSpeedCallable, SampleInfo
from .folder import KSpeedFolder
from .image_folder import KSpeedImageFolder
from .lease import release_all as release_leases
from .meta import KSpeedMetaDataset
from .mini_epoch import MiniEpochSampler
from .prefetch import ClairvoyantSampler
from .priority import PrioritySampler
from .tar_folder import KSpeedTarFolder
from .tar_shards import KSpeedWebDataset
from .untar_folder import KSpeedUntarFolder

__all__ = [
    "ClairvoyantSampler",
    "KSpeedCallable",
    "KSpeedDataset",
    "KSpeedFolder",
    "KSpeedImageFolder",
    "KSpeedMetaDataset",
    "KSpeedTarFolder",
    "KSpeedUntarFolder",
    "KSpeedWebDataset",
    "MiniEpochSampler",
    "PrioritySampler",
    "SampleInfo",
    "release_leases",
]
