"""Every command of `marlhf` (marlhf.cli parses the command line and is the one error boundary):

- `COMMANDS`: the config commands, whose options are a config dataclass (a YAML file with `--config`, then the
  flags): `sft`, `reward`, `dpo`, `ppo` (marlhf.trainers) and `evaluate` (marlhf.evaluation.evaluate); the module
  is imported only when its command runs.
- `TOOLS`: the commands with flags of their own, each a `Tool` (marlhf.commands.base): `plot`, `judge`,
  `human-eval` (commands/evaluation.py), `demo` (commands/demo.py), `vllm-serve` (commands/serve.py) and `envs` (commands/envs.py).

A new command is a `Tool` in a module here (or a row of `COMMANDS` for a config command), added to its dict.
"""

from __future__ import annotations

from marlhf.commands.base import Tool
from marlhf.commands.demo import DEMO
from marlhf.commands.envs import ENVS_COMMAND
from marlhf.commands.evaluation import EVALUATION_TOOLS
from marlhf.commands.serve import VLLM_SERVE

__all__ = ["COMMANDS", "TOOLS", "Tool"]

# command -> (module, config class, train function, one-line description)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "sft": ("marlhf.trainers.sft", "SFTConfig", "train_sft", "supervised fine-tuning on prompt/response records"),
    "reward": ("marlhf.trainers.reward", "RewardConfig", "train_reward_model",
               "reward model on preference pairs (Bradley-Terry loss)"),
    "dpo": ("marlhf.trainers.dpo", "DPOConfig", "train_dpo",
            "direct preference optimization against a frozen reference"),
    "ppo": ("marlhf.trainers.ppo", "PPOConfig", "train_ppo",
            "PPO / MA-PPO with macro actions (and the critic-free baselines)"),
    "evaluate": ("marlhf.evaluation.evaluate", "EvaluateConfig", "run_evaluation",
                 "reward-model scores on validation prompts, checkpoint comparison, best-of-N, APPS pass@k, "
                 "episodes of an environment"),
}

# the file-based evaluation tools, the embedded demo and the rollout server
TOOLS: dict[str, Tool] = {**EVALUATION_TOOLS, "demo": DEMO, "vllm-serve": VLLM_SERVE, "envs": ENVS_COMMAND}
