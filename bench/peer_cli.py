"""The command line both peer drivers share (standard library only: it runs
inside the peers' own virtualenvs)."""

from __future__ import annotations

import argparse


def parser(prog: str, *, prepare: str, work: str) -> tuple[argparse.ArgumentParser,
                                                           argparse.ArgumentParser]:
    """``prepare --url U --count N`` and ``work --url U …``; returns the parser
    and the ``work`` subparser, for the peer's own worker options."""
    top = argparse.ArgumentParser(prog=prog)
    commands = top.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help=prepare)
    prep.add_argument("--url", required=True)
    prep.add_argument("--count", type=int, required=True)
    serve = commands.add_parser("work", help=work)
    serve.add_argument("--url", required=True)
    return top, serve
