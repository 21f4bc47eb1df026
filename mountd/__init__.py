"""kspeedfs-mountd: keeps the mounts declared in /etc/kspeedfs/mounts.d alive."""
