"""The FUSE side: the kernel protocol loop, the filesystem, mount and mount.kspeedfs."""
