"""Where a dataset's bytes come from: local folders and object stores, scanned, copied, re-read."""
