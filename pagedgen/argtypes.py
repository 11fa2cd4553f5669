"""argparse value types shared by the ``pagedgen`` command and ``pagedgen bench``.

They live apart from ``pagedgen/cli.py`` so that the bench, which the command hands ``pagedgen bench ...`` to,
does not import the command back (docs/architecture.md, "Who imports whom").
"""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a positive integer."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
