"""`marlhf demo`: the embedded demo's tool; the demo itself is marlhf.demo, imported when the command runs."""

from __future__ import annotations

import argparse

from marlhf.commands.base import Tool
from marlhf.errors import MarlhfError


def _demo_arguments(parser: argparse.ArgumentParser) -> None:
    from marlhf.demo.config import DemoConfig

    DemoConfig.add_arguments(parser)
    parser.add_argument("--quick", action="store_true",
                        help="shortened run (under a minute): one seed, few steps; applies to the options left at "
                             "their defaults")


def _run_demo(arguments: argparse.Namespace) -> int:
    from marlhf.demo.config import DemoConfig
    from marlhf.demo.pipeline import run_demo

    try:
        config = DemoConfig.from_arguments(arguments)  # defaults < --config file < flags
        if arguments.quick:  # the quick preset replaces the options left at their defaults
            defaults = DemoConfig().to_dict()
            config = DemoConfig.quick(**{k: v for k, v in config.to_dict().items() if v != defaults[k]})
    except ValueError as error:  # a bad option: a usage error like the trainers' (exit 2), naming the command
        raise MarlhfError(f"demo: {error}") from None
    run_demo(config)
    return 0


DEMO = Tool(_demo_arguments, _run_demo,
            "the whole pipeline on a synthetic task with a gold reward, on CPU: PPO vs MA-PPO (writes "
            "summary.json, curves.png, report.md)")
