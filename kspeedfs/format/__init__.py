"""What is on disk and on the wire: errors, names, config, manifest, layout, placement, codec."""
