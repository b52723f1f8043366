# Run: python -m schedulers.console --connect tcp://127.0.0.1:5555
#      python -m schedulers.console --connect tcp://127.0.0.1:5555 --exec "submit examples/gpt_config.json; run job0 20"
"""The actorpipe console: watch and steer the jobs of a running cluster (see ``help`` at its prompt)."""

from __future__ import annotations

import argparse
import os
import sys

from schedulers.console.repl import console_main
from transport.loop import run

DEFAULT_HISTORY = os.path.join(os.path.expanduser("~"), ".actorpipe_history")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m schedulers.console", description=__doc__)
    parser.add_argument("--connect", required=True, metavar="ADDRESS",
                        help="the head's address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--exec", dest="script", metavar="COMMANDS",
                        help="run these commands (';'-separated) without a prompt; exit 1 at the first that fails")
    parser.add_argument("--history", default=DEFAULT_HISTORY, metavar="FILE",
                        help=f"prompt history file (default {DEFAULT_HISTORY}; '' keeps none)")
    parser.add_argument("--bind", default="tcp://127.0.0.1:0",
                        help="where this console listens for replies; the head must reach it")
    parser.add_argument("--allow-remote", action="store_true", help="permit a --bind that is not loopback")
    parser.add_argument("--keys", metavar="DIR", default=None,
                        help="the cluster's key directory (default: $ACTORPIPE_KEYS or ~/.config/actorpipe/keys)")
    parser.add_argument("--identity", default="client", metavar="NAME",
                        help="which keypair in --keys this console uses (default: client; admin may do anything)")
    parser.add_argument("--insecure", action="store_true", help="connect without keys, to a head started --insecure")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run(console_main(args.connect, script=args.script, history_path=args.history or None,
                            bind=args.bind, allow_remote=args.allow_remote, keys=args.keys, identity=args.identity,
                            insecure=args.insecure))


if __name__ == "__main__":
    sys.exit(main())
