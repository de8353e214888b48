"""The command line the peer drivers share (standard library only: it runs
inside the peers' own virtualenvs)."""

from __future__ import annotations

import argparse


def parser(prog: str, *, prepare: str, work: str) -> tuple[argparse.ArgumentParser,
                                                           argparse.ArgumentParser]:
    """``prepare --url U --count N`` and ``work --url U …``; returns the parser
    and the ``work`` subparser, for the peer's own worker options."""
    top, _, serve = _parsers(prog, prepare=prepare, work=work)
    return top, serve


def _parsers(prog: str, *, prepare: str, work: str) -> tuple[
        argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog=prog)
    commands = top.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help=prepare)
    prep.add_argument("--url", required=True)
    prep.add_argument("--count", type=int, required=True)
    serve = commands.add_parser("work", help=work)
    serve.add_argument("--url", required=True)
    return top, prep, serve


def steps_parser(prog: str, *, prepare: str) -> tuple[argparse.ArgumentParser,
                                                       argparse.ArgumentParser]:
    """The steps scenario's drivers: :func:`parser`, with ``prepare``'s
    ``--file`` (steps record their start there, and sleep ``--sleep`` s)."""
    top, prep, serve = _parsers(prog, prepare=prepare, work="run the worker until SIGTERM")
    prep.add_argument("--file", help="steps record their start here and sleep")
    prep.add_argument("--sleep", type=float, default=0.05)
    return top, serve
