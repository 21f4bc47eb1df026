"""The `kspeedfs` command: one module per command group, one-line errors, documented exit codes.

`parser` builds the command line, `commands` runs a command; `datasets`, `node`, `mounts`,
`security` and `setup` hold the commands, `settings` and `tables` what they share.
"""

from kspeedfs.cli.commands import main
from kspeedfs.cli.parser import build_parser

__all__ = ["build_parser", "main"]
