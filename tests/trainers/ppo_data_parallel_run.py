"""One PPO run for tests/trainers/test_ppo_distributed.py, under `torchrun` (any number of processes) or alone:

    python -m torch.distributed.run --nproc_per_node 2 tests/trainers/ppo_data_parallel_run.py \
        OUT PROMPTS_PER_PROCESS ADVANTAGE
"""

from __future__ import annotations

import sys

from tests.conftest import build_tiny_causal_lm, build_tiny_tokenizer
from tests.trainers.test_ppo import RECORDS, count_e

from marlhf.trainers.ppo import PPOConfig, train_ppo


def main(output_dir: str, prompts_per_process: int, advantage: str) -> None:
    tokenizer = build_tiny_tokenizer()
    rollout_size = prompts_per_process * 2
    config = PPOConfig(output_dir=output_dir, model_name_or_path="unused", per_device_batch_size=prompts_per_process,
                       num_samples_per_prompt=2, mini_batch_size=rollout_size, gradient_accumulation_steps=2,
                       max_prompt_length=32, max_response_length=6, max_length=64, max_steps=2, ngram=2,
                       advantage=advantage, whiten_advantages=advantage == "gae", learning_rate=1e-2,
                       critic_learning_rate=1e-2, warmup_ratio=0.0, lr_scheduler="constant", save_steps=0, seed=5)
    train_ppo(config, RECORDS, policy=build_tiny_causal_lm(tokenizer), tokenizer=tokenizer, reward_fn=count_e)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
