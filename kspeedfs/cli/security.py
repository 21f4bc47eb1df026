"""Security commands: cluster tokens, users with passwords, TLS certificates."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kspeedfs.cli.settings import settings_from
from kspeedfs.format import auth
from kspeedfs.format.errors import InvalidArgument


def cmd_token(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    token_file = settings.token_file
    if args.role == "admin":
        dest = Path(args.output) if args.output else token_file
        auth.write_token(dest, auth.new_admin_token(), overwrite=args.force)
    else:
        if not args.output:
            raise InvalidArgument(f"--output is required for a {args.role} token")
        dest = Path(args.output)
        token = auth.derive_token(auth.read_token(token_file), args.role)
        auth.write_token(dest, token, overwrite=args.force)
    print(f"wrote a {args.role} token to {dest} (mode 0600)")
    return 0


def cmd_user(args: argparse.Namespace) -> int:
    from kspeedfs.format import users

    settings = settings_from(args, users_file=args.users_file)
    path = settings.users_path()
    if args.user_command == "list":
        known = users.load_users(path)
        for u in sorted((known.users if known else {}).values(), key=lambda u: u.name):
            print(f"{u.name}  {u.role}")
        return 0
    if args.user_command == "del":
        users.delete_user(path, args.name)
        print(f"deleted user {args.name} from {path}")
        return 0
    users.validate_user(args.name)
    password = _new_password(args.password_stdin)
    users.add_user(path, args.name, args.role, password)
    print(f"user {args.name} ({args.role}) in {path} (mode 0600)")
    return 0


def _new_password(from_stdin: bool) -> str:
    import getpass

    if from_stdin:
        return sys.stdin.readline().rstrip("\n")
    first = getpass.getpass("password: ")
    if getpass.getpass("again: ") != first:
        raise InvalidArgument("the two passwords differ")
    return first


def cmd_tls(args: argparse.Namespace) -> int:
    from kspeedfs.cli import tlsca

    if args.tls_command == "new-ca":
        cert, key = tlsca.new_ca(Path(args.dir), args.days, args.force)
        print(f"wrote {cert} and its key {key} (0600); set tls_ca = {cert.resolve()} everywhere")
        return 0
    ca = Path(args.ca)
    cert, key = tlsca.issue(args.host, ca, Path(args.out), args.alt, args.days, args.force)
    print(
        f"wrote {cert} and its key {key} (0600); set tls_cert = {cert.resolve()}, "
        f"tls_key = {key.resolve()}, tls_ca = {(ca / tlsca.CA_CERT).resolve()}"
    )
    return 0
