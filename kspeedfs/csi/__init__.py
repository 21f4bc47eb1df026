"""The Kubernetes CSI node plugin (`kspeedfs csi`), its volumes and the manifests that install it."""
