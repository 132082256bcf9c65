"""Every committed config loads to the options it had when the snapshot was taken (tests/fixtures/
config_snapshot.json, written at the commit before issue 36's refactor): configs/*.yaml, the demo's config of the
lambda study, and the PPO options of every run of the credit-assignment studies (Study I's cells, Study II's arms)
and of the demo's critic-free baselines. Plug-ins and options may move between modules; what a config means may
not. An option added later is not in the snapshot and is not compared; an option renamed since (its old name kept as
an alias, `RENAMED`) is compared under its new name.

    python -m tests.test_config_snapshot   # rewrites the snapshot: only for a change meant to alter a config's meaning
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "fixtures" / "config_snapshot.json"
MISSING = "<missing>"


def _ppo_options(config) -> dict[str, Any]:
    """A PPOConfig's options, and each plug-in it names with the options that plug-in gets."""
    from marlhf.trainers.ppo_config import PLUGINS

    plugins = {}
    for kind in PLUGINS:
        options = config.plugin_options(kind)
        plugins[kind] = {"name": config.plugin(kind).name,
                         **(dataclasses.asdict(options) if options is not None else {})}
    return {"options": config.to_dict(), "plugins": plugins}


def resolved_options() -> dict[str, Any]:
    """{config's name: its resolved options}, JSON-ready."""
    from marlhf.demo.config import DemoConfig
    from marlhf.demo.pipeline import critic_free_options
    from marlhf.trainers.ppo import PPOConfig
    from marlhf.trainers.reward import RewardConfig
    from marlhf.trainers.sft import SFTConfig

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import credit_assignment as study_one
    import credit_assignment_lambda as study_two

    classes = {"sft": SFTConfig, "reward": RewardConfig, "ppo": PPOConfig}
    resolved: dict[str, Any] = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = classes[path.stem.split("-")[-1]].from_yaml(path)
        resolved[f"configs/{path.name}"] = _ppo_options(config) if isinstance(config, PPOConfig) else config.to_dict()
    demo = ROOT / "benchmarks" / "results" / "demo" / "lam1" / "demo_config.yaml"
    resolved[str(demo.relative_to(ROOT))] = DemoConfig.from_yaml(demo).to_dict()
    for _, _, cell in study_one.grid():
        resolved[f"study1/{cell}"] = _ppo_options(PPOConfig(**study_one.cell_options(cell)))
    design = study_two.DESIGN
    jobs = study_two.tuning_jobs(design) + [job for job in study_two.confirmation_jobs(design)
                                            if job[3] in design.fixed_arms]
    for job in jobs:
        phase, task, setup, arm = job[:4]
        resolved[f"study2/{phase}/{task}/{setup}/{arm}"] = _ppo_options(
            PPOConfig(**study_two.job_options(job, design, None)))
    for method in ("rloo", "grpo", "reinforce"):
        resolved[f"demo/{method}"] = _ppo_options(PPOConfig(**critic_free_options(method)))
    return json.loads(json.dumps(resolved))


def _like(value: Any, expected: Any) -> Any:
    """`value` cut to the keys of `expected` (recursively), a key it lacks shown as MISSING."""
    if not isinstance(expected, dict) or not isinstance(value, dict):
        return value
    return {key: _like(value.get(key, MISSING), sub) for key, sub in expected.items()}


def test_every_committed_config_loads_to_its_snapshot_options():
    from marlhf.trainers.ppo_config import PPOConfig

    snapshot = json.loads(SNAPSHOT.read_text())
    now = resolved_options()
    assert sorted(set(snapshot) - set(now)) == []
    assert len(snapshot) > 50  # the configs, the demo's, and the studies' runs
    for name, expected in snapshot.items():
        if "options" in expected:  # a PPOConfig's
            expected["options"] = PPOConfig.rename_old_names(expected["options"])
        assert _like(now[name], expected) == expected, name


if __name__ == "__main__":
    lines = [f"{json.dumps(name)}: {json.dumps(options, sort_keys=True)}" for name, options in
             sorted(resolved_options().items())]  # one config a line
    SNAPSHOT.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {SNAPSHOT}")
