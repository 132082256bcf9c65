"""The embedded demo: pretrain -> SFT -> reward model -> PPO vs MA-PPO on a synthetic task with a gold reward.

    from marlhf.demo import DemoConfig, run_demo
    summary = run_demo(DemoConfig(out="demo_out"))          # or DemoConfig.quick(out=...) for a short run

Command line: `marlhf demo --out DIR [--quick] [--seeds 0 1 2] [--terminations fixed:3 randomized ...]`.
Imports of the trainers happen in `run_demo`'s module, so importing the task alone stays light.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "DemoConfig":
        from marlhf.demo.config import DemoConfig

        return DemoConfig
    if name == "run_demo":
        from marlhf.demo.pipeline import run_demo

        return run_demo
    raise AttributeError(f"module 'marlhf.demo' has no attribute {name!r}")


__all__ = ["DemoConfig", "run_demo"]
