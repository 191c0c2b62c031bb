"""`python -m minedraft ...`: the same command line as the `minedraft` script."""

from .cli import entry

entry()
