"""What a tool of the `marlhf` command is: its flags, its body and its one-line description."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple


class Tool(NamedTuple):
    """A command that takes its own flags rather than a config (marlhf.commands.TOOLS); heavy imports happen in
    `run`, so `marlhf --help` stays quick."""

    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str
