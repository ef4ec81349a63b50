"""``ricllm keys``: CurveZMQ key pairs for the server and its clients (no torch, no engine)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ricllm.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


# ------------------------------------------------------------------------------ ricllm keys

def create_key_pair(folder: str | Path, name: str, force: bool = False) -> tuple[Path, Path]:
    """``NAME.key`` (public) and ``NAME.key_secret`` in ``folder``, by ``zmq.auth.create_certificates``.

    Existing files are kept unless ``force``: overwriting a server key locks out every client.
    """
    import zmq.auth

    if not _NAME.match(name):
        raise ConfigError(f"--name {name!r}: use letters, digits, '.', '_' and '-'")
    folder = Path(folder)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    existing = [str(path) for path in (public, secret) if path.exists()]
    if existing and not force:
        raise ConfigError(f"{' and '.join(existing)} already exist; pass --force to replace them")
    folder.mkdir(parents=True, exist_ok=True)
    made = zmq.auth.create_certificates(str(folder), name)
    return Path(made[0]), Path(made[1])


def _cmd_keys(args: argparse.Namespace) -> int:
    public, secret = create_key_pair(args.dir, args.name, args.force)
    print(f"public key: {public}\nsecret key: {secret}")
    if args.name == "server":
        print(f"server: controls.curve.server_secret_key_file = {secret}; clients need {public}",
              file=sys.stderr)
    else:
        print(f"client: copy {public} into the server's authorized_keys_dir; connect with "
              f"--curve-client-keys {secret}", file=sys.stderr)
    return 0


def add_keys_subparser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="generate a CurveZMQ key pair (NAME.key, NAME.key_secret)",
                          description="Write a CurveZMQ key pair with zmq.auth.create_certificates: the "
                                      "server's (--name server) or a client's (e.g. --name client).")
    keys.add_argument("dir", help="folder for the key files (created if missing)")
    keys.add_argument("--name", default="server", help="file name stem: server, client or any other (default: server)")
    keys.add_argument("--force", action="store_true", help="replace existing key files")
    keys.set_defaults(func=_cmd_keys)
