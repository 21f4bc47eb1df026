"""`python -m kspeedfs.cli`: how the harness and kspeedfs-mountd start the command."""

import sys

from kspeedfs.cli import main

sys.exit(main())
