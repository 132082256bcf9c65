"""Training loops on Accelerate: sft, reward (reward model), dpo, ppo; `common` holds the shared pieces.

Each module exposes a *Config dataclass and a train_* function taking (config, records=None, ...); the
CLI (`marlhf sft|reward|dpo|ppo`) builds the config from flags/YAML and the records from --dataset.
Modules are not imported here, so importing one trainer does not import the others.
"""
