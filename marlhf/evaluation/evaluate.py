"""`marlhf evaluate`: generate for validation prompts, score, summarise, compare, best-of-N, pass@k.

- Reward-model evaluation (the paper's: 2,000 validation prompts drawn with seed 1234): one response
  per prompt, scored by the reward model on prompt + response + EOS, exactly as it was trained
  (`encode_prompt_response`); OUTPUT_DIR/responses.jsonl (prompt / response / score) and summary.json
  (mean, std, quantiles of the scores, and the mean repeated word-3-gram fraction of the responses).
- `compare`: the same for every checkpoint on the same prompts (each in OUTPUT_DIR/<name>/), then the
  score histograms and the per-prompt scatter of the first checkpoint against each other one.
- `best_of_n`: for each temperature, max(N) samples per prompt; best-of-N is the mean over prompts of
  the best reward-model score among the first N samples. A table (JSON + markdown) and a heat map.
- `pass_at_k` (APPS records with unit tests): `samples_per_prompt` programs per problem, run in the
  code sandbox; pass@k by difficulty (marlhf.evaluation.passk).
- `env`: episodes of an environment played by the policy, scored by the environment (marlhf.evaluation.episodes):
  success rate and mean return with their intervals, pass@k over a dataset's tasks; summary.json and
  episodes.jsonl (docs/envs.md).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from tqdm import tqdm

from marlhf.config import ConfigBase, option
from marlhf.data.encoding import collate_prompt_response, encode_prompt_response, pad_sequences, prompt_token_ids
from marlhf.data.records import prompt_records
from marlhf.data.tasks import get_task
from marlhf.envs.datasets import library_records
from marlhf.evaluation.episodes import evaluate_episodes
from marlhf.evaluation.judge import write_jsonl
from marlhf.evaluation.passk import apps_pass_at_k
from marlhf.evaluation.plots import pyplot
from marlhf.metrics import text_repetition
from marlhf.multiturn import MultiTurnOptions
from marlhf.plugins import Plugin
from marlhf.engines.hf import generate_responses
from marlhf.rollout import decode_responses

QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


@dataclasses.dataclass(kw_only=True)
class EvaluateConfig(ConfigBase):
    output_dir: str = option("outputs/eval", "directory for responses.jsonl, summary.json, tables and figures")
    seed: int = option(1234, "seed of the prompt sample and of sampling (the paper: 1234)")
    model_name_or_path: str = option("outputs/ppo/final", "policy checkpoint to evaluate")
    compare: tuple[str, ...] | None = option(
        None, "more checkpoints to evaluate on the same prompts and compare with model_name_or_path")
    reward_model: str | None = option(None, "reward-model checkpoint (ScalarHeadModel) that scores the responses")
    dataset: str | None = option(
        None, "dataset id or local .jsonl/.parquet path ('eval' records), or reasoning_gym:SPEC; with env, the tasks "
              "of its episodes (a SkyRL dataset file for skyrl_gym:ID) (none: the paper's "
              "openai/summarize_from_feedback, or with env the task each environment draws from its episode's seed)")
    dataset_task: str | None = option(
        None, "a local dataset file holds raw rows of this task's Hub schema: tldr, hh, webgpt, apps, another task "
              "registered with marlhf.data.tasks.register_task, or a dotted path package.module:TASK (none: rows "
              "already in the eval schema)")
    num_samples: int | None = option(
        None, "evaluation prompts (with env: tasks) drawn with `seed` (none: the paper's, 2,000, every APPS test "
              "problem, or every record of env's dataset; env without a dataset needs it: its episodes' seeds are "
              "seed, seed + 1, ...)", ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("float32", "dtype to load the models in")
    batch_size: int = option(16, "sequences per generation / scoring batch", ge=1)
    max_prompt_length: int = option(512, "prompts are truncated to their last N tokens", ge=1)
    max_response_length: int = option(512, "tokens generated at most per response", ge=1)
    temperature: float = option(0.8, "sampling temperature", gt=0)
    top_k: int = option(50, "top-k sampling (0: off)", ge=0)
    top_p: float = option(1.0, "nucleus sampling", gt=0, le=1)
    best_of_n: tuple[int, ...] | None = option(
        None, "best-of-N grid over these N (the paper: 4 8 16 32) and `best_of_n_temperatures`", ge=1)
    best_of_n_temperatures: tuple[float, ...] = option((0.2, 0.4, 0.6, 0.8, 1.0, 1.2), "temperatures of the best-of-N grid", gt=0)
    pass_at_k: tuple[int, ...] | None = option(
        None, "APPS: report pass@k for these k (e.g. 1 5) by difficulty instead of reward-model scores; with env: "
              "pass@k over the dataset's tasks (an episode passes when it succeeds, success_at)", ge=1)
    samples_per_prompt: int = option(
        10, "pass_at_k: programs sampled per APPS problem, or episodes played per task of env (n >= max k)", ge=1)
    code_timeout_s: float = option(4.0, "APPS: wall-time limit per unit test", gt=0)
    env: str | None = option(
        None, "evaluate episodes of this environment (marlhf.envs: reasoning_gym:NAME, textarena:ID, skyrl_gym:ID, "
              "a registered name, package.module:Class, path/to/file.py:Class) played by the policy: success rate "
              "and mean return with their intervals (and pass@k), no reward model")
    env_options: dict[str, Any] | None = option(None, "the environment's own options, a YAML mapping")
    multi_turn_options: dict[str, Any] | None = option(
        None, "the episodes' limits (marlhf.multiturn.MultiTurnOptions), a YAML mapping such as '{max_turns: 3}'")
    success_at: float = option(1.0, "env: an episode succeeds when its return reaches this (1: a verified answer, "
                                    "a won game)")

    def validate(self) -> None:
        super().validate()
        if self.dataset_task is not None:
            get_task(self.dataset_task)  # an unknown name or a path that does not import stops here
        if self.env is not None or self.env_options or self.multi_turn_options:
            self._check_env()
            return
        if self.pass_at_k is not None:
            if max(self.pass_at_k) > self.samples_per_prompt:
                raise ValueError(f"pass_at_k: every k must be <= samples_per_prompt ({self.samples_per_prompt}), "
                                 f"got {self.pass_at_k}")
            if self.compare or self.best_of_n:
                raise ValueError("pass_at_k cannot be combined with compare or best_of_n")
        elif self.reward_model is None:
            raise ValueError("reward_model is required (except with pass_at_k, which runs unit tests)")
        if self.compare and self.best_of_n:
            raise ValueError("compare and best_of_n are separate runs; give one of them")


    def _check_env(self) -> None:
        """env evaluates episodes: no reward model, comparison or best-of-N; pass@k needs tasks to sample again."""
        if self.env is None:
            raise ValueError("env_options and multi_turn_options need env (the environment they configure)")
        refused = [name for name in ("reward_model", "compare", "best_of_n") if getattr(self, name)]
        if refused:
            raise ValueError(f"env={self.env!r} with {', '.join(refused)}: an environment scores its episodes itself")
        if self.dataset is None and self.num_samples is None:
            raise ValueError(f"env={self.env!r} without a dataset: give num_samples, the number of episodes")
        if self.pass_at_k is not None and (self.dataset is None or max(self.pass_at_k) > self.samples_per_prompt):
            raise ValueError(f"pass_at_k with env: every k <= samples_per_prompt ({self.samples_per_prompt}) episodes "
                             "of each task of a dataset (without one, each seed is its own task)")
        self.multi_turn  # the property checks the limits: an unknown or out-of-bounds one stops here

    @property
    def multi_turn(self) -> MultiTurnOptions:
        """The episodes' limits: multi_turn_options' values (each checked, as a plug-in's options are), their
        declared defaults for the rest."""
        block = Plugin("block", "multi_turn_options", MultiTurnOptions, MultiTurnOptions)
        return block.make_options(self.multi_turn_options or {})


# ----------------------------------------------------------------------------- generation and scoring


@torch.no_grad()
def sampled_batches(policy: torch.nn.Module, tokenizer, prompts: Sequence[str], *, samples_per_prompt: int = 1,
                    batch_size: int = 16, max_prompt_length: int = 512, max_new_tokens: int = 512,
                    temperature: float = 0.8, top_k: int = 50, top_p: float = 1.0,
                    ) -> Iterator[tuple[tuple[torch.Tensor, ...], list[str]]]:
    """Sampled responses batch by batch: `((prompt_ids, prompt_mask, response_ids, response_mask), texts)` (texts
    decoded, special tokens removed), `samples_per_prompt` consecutive rows per prompt. Prompts keep their last
    `max_prompt_length` tokens and a leading `<bos>`. Sampling uses torch's global RNG: seed it first."""
    device = next(policy.parameters()).device
    prompt_tokens = [prompt_token_ids(tokenizer, p, max_prompt_length) for p in prompts]
    rows = [ids for ids in prompt_tokens for _ in range(samples_per_prompt)]  # a prompt's samples are consecutive
    for start in tqdm(range(0, len(rows), batch_size), desc="generate", disable=None, leave=False):
        prompt_ids, prompt_mask = pad_sequences(rows[start:start + batch_size], tokenizer.pad_token_id, "left")
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.bool().to(device)
        response_ids, response_mask = generate_responses(
            policy, prompt_ids, prompt_mask, max_new_tokens=max_new_tokens,
            temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)
        yield (prompt_ids, prompt_mask, response_ids, response_mask), decode_responses(tokenizer, response_ids,
                                                                                       response_mask)


def generate_texts(policy: torch.nn.Module, tokenizer, prompts: Sequence[str], *, samples_per_prompt: int = 1,
                   **sampling: Any) -> list[list[str]]:
    """`samples_per_prompt` sampled responses for each prompt (`sampling`: the options of sampled_batches)."""
    texts = [text for _, batch_texts in sampled_batches(policy, tokenizer, prompts,
                                                        samples_per_prompt=samples_per_prompt, **sampling)
             for text in batch_texts]
    return [texts[i * samples_per_prompt:(i + 1) * samples_per_prompt] for i in range(len(prompts))]


@torch.no_grad()
def reward_model_scores(reward_model: torch.nn.Module, tokenizer, prompts: Sequence[str], responses: Sequence[str], *,
                        batch_size: int = 16, max_prompt_length: int = 512, max_length: int = 1024) -> list[float]:
    """Reward-model score of each (prompt, response): prompt + response + EOS encoded as in reward-model
    training, the score read at the last real token."""
    if len(prompts) != len(responses):
        raise ValueError(f"prompts and responses must have the same length, got {len(prompts)} and {len(responses)}")
    device = next(reward_model.parameters()).device
    was_training = reward_model.training
    reward_model.eval()
    scores: list[float] = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="score", disable=None, leave=False):
        examples = [encode_prompt_response(tokenizer, p, r, max_prompt_length, max_length)
                    for p, r in zip(prompts[start:start + batch_size], responses[start:start + batch_size])]
        batch = collate_prompt_response(examples, tokenizer.pad_token_id, device)
        scores += reward_model.score(batch["input_ids"], batch["attention_mask"]).tolist()
    reward_model.train(was_training)
    return scores


def summarize_scores(scores: Sequence[float]) -> dict[str, float]:
    """count, mean, std (population), min, max and the QUANTILES of the scores."""
    if not len(scores):
        raise ValueError("scores is empty")
    values = np.asarray(scores, dtype=np.float64)
    summary = {"count": int(values.size), "mean": float(values.mean()), "std": float(values.std()),
               "min": float(values.min()), "max": float(values.max())}
    summary.update({f"q{round(q * 100):02d}": float(np.quantile(values, q)) for q in QUANTILES})
    return summary


def best_of_n_table(scores: np.ndarray, ns: Sequence[int]) -> list[float]:
    """Mean over prompts of the best score among the first N samples, for each N: `scores` [prompts, samples]."""
    if scores.ndim != 2 or max(ns) > scores.shape[1]:
        raise ValueError(f"scores must be [prompts, samples] with at least max(ns)={max(ns)} samples, got {scores.shape}")
    return [float(scores[:, :n].max(axis=1).mean()) for n in ns]


# ----------------------------------------------------------------------------- figures and tables


def plot_score_histograms(scores: dict[str, Sequence[float]], path: str | Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
    edges = np.histogram_bin_edges(np.concatenate([np.asarray(s) for s in scores.values()]), bins=30)
    for name, values in scores.items():
        ax.hist(values, bins=edges, alpha=0.45, label=f"{name} (mean {np.mean(values):.3f})")
    ax.set_xlabel("reward-model score")
    ax.set_ylabel("prompts")
    ax.set_title("score distributions")
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_score_scatter(x: Sequence[float], y: Sequence[float], x_name: str, y_name: str, path: str | Path) -> None:
    plt = pyplot()
    x, y = np.asarray(x), np.asarray(y)
    fig, ax = plt.subplots(figsize=(5, 5), layout="constrained")
    ax.scatter(x, y, s=8, alpha=0.5)
    low, high = min(x.min(), y.min()), max(x.max(), y.max())
    ax.plot([low, high], [low, high], color="gray", linestyle="--", linewidth=1, label="y = x")
    ax.set_xlabel(f"{x_name}: reward-model score")
    ax.set_ylabel(f"{y_name}: reward-model score")
    ax.set_title(f"per prompt: {y_name} above the line in {np.mean(y > x):.1%} of prompts", fontsize=10)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def best_of_n_markdown(table: dict[str, Any]) -> str:
    temperatures = table["temperatures"]
    lines = ["| N \\ temperature | " + " | ".join(f"{t:g}" for t in temperatures) + " |",
             "|---" * (len(temperatures) + 1) + "|"]
    for n, row in zip(table["n"], table["mean_best_score"]):
        lines.append(f"| {n} | " + " | ".join(f"{v:.4f}" for v in row) + " |")
    return "\n".join(lines) + "\n"


def plot_best_of_n(table: dict[str, Any], path: str | Path) -> None:
    plt = pyplot()
    values = np.asarray(table["mean_best_score"])
    fig, ax = plt.subplots(figsize=(1.1 * len(table["temperatures"]) + 2.5, 0.7 * len(table["n"]) + 1.8),
                           layout="constrained")
    image = ax.imshow(values, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(table["temperatures"])), [f"{t:g}" for t in table["temperatures"]])
    ax.set_yticks(range(len(table["n"])), [str(n) for n in table["n"]])
    ax.set_xlabel("temperature")
    ax.set_ylabel("N")
    middle = (values.min() + values.max()) / 2
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            ax.text(j, i, f"{values[i, j]:.3f}", ha="center", va="center", fontsize=8,
                    color="black" if values[i, j] > middle else "white")
    fig.colorbar(image, ax=ax, label="mean best-of-N reward-model score")
    ax.set_title("best-of-N")
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- the command


def _load_policy(path: str, dtype: str, device: torch.device):
    from marlhf.modeling import load_causal_lm, load_tokenizer

    return load_causal_lm(path, dtype=dtype).to(device).eval(), load_tokenizer(path, padding_side="left")


def _load_reward_model(path: str, dtype: str, device: torch.device):
    from marlhf.modeling import ScalarHeadModel, load_tokenizer

    return ScalarHeadModel.from_pretrained(path, dtype=dtype).to(device).eval(), load_tokenizer(path)


def _names(paths: Sequence[str]) -> list[str]:
    """Short distinct names for checkpoints: the last path components that tell them apart."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = [re.sub(r"[^A-Za-z0-9_.-]+", "_", "_".join(p[-depth:])) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [f"model{i}" for i in range(len(paths))]


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def run_evaluation(config: EvaluateConfig, records: list[str] | list[dict[str, Any]] | None = None,
                   device: str | None = None) -> dict[str, Any]:
    """Run what `config` asks for and return the summary written to OUTPUT_DIR (see the module docstring).
    `records`: evaluation prompts (strings) or records ({"prompt", ...}) used as given; default:
    `config.num_samples` records of `config.dataset` drawn with `config.seed` through load_records. The summary
    is also printed."""
    records = prompt_records(records) if records is not None else None
    result = _evaluate(config, records, torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")))
    print(json.dumps(result, indent=2))
    return result


PAPER_EVAL_PROMPTS = 2000  # the paper's evaluation prompts on TL;DR, HH and WebGPT (APPS: all 5,000 problems)
PAPER_DATASET = "openai/summarize_from_feedback"  # without a dataset: TL;DR, the paper's first task


def _is_apps(config: EvaluateConfig) -> bool:
    return config.dataset_task == "apps" or config.dataset == "codeparrot/apps"


def _output_dir(config: EvaluateConfig) -> Path:
    """OUTPUT_DIR, made, with the run's config.yaml."""
    output_dir = Path(config.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config.save_yaml(output_dir / "config.yaml")
    return output_dir


def _evaluate(config: EvaluateConfig, records: list[dict[str, Any]] | None, device: torch.device) -> dict[str, Any]:
    if config.env is not None:
        return _episodes(config, records, device)
    if records is None:
        from marlhf.data import load_records

        records = load_records(config.dataset or PAPER_DATASET, "eval", task=config.dataset_task, seed=config.seed,
                               max_samples=config.num_samples if config.num_samples is not None else
                               None if _is_apps(config) else PAPER_EVAL_PROMPTS)
    if not records:
        raise ValueError("no evaluation records")
    prompts = [r["prompt"] for r in records]
    output_dir = _output_dir(config)
    generation = dict(batch_size=config.batch_size, max_prompt_length=config.max_prompt_length,
                      max_new_tokens=config.max_response_length, top_k=config.top_k, top_p=config.top_p)

    if config.pass_at_k is not None:
        return _pass_at_k(config, records, generation, device, output_dir)

    paths = [config.model_name_or_path, *(config.compare or ())]
    if config.best_of_n is not None:
        return _best_of_n(config, paths[0], prompts, generation, device, output_dir)

    responses = {}
    for name, path in zip(_names(paths), paths):
        torch.manual_seed(config.seed)  # every checkpoint samples from the same RNG state
        policy, tokenizer = _load_policy(path, config.dtype, device)
        responses[name] = [s[0] for s in generate_texts(policy, tokenizer, prompts, temperature=config.temperature,
                                                        **generation)]
        del policy
    reward_model, rm_tokenizer = _load_reward_model(config.reward_model, config.dtype, device)
    summaries, scores = {}, {}
    for name, texts in responses.items():
        scores[name] = reward_model_scores(reward_model, rm_tokenizer, prompts, texts, batch_size=config.batch_size,
                                           max_prompt_length=config.max_prompt_length,
                                           max_length=config.max_prompt_length + config.max_response_length)
        summaries[name] = {**summarize_scores(scores[name]),
                           "repeated_word_3gram_fraction": float(np.mean(text_repetition(texts, n=3)))}
        model_dir = output_dir if len(paths) == 1 else output_dir / name
        model_dir.mkdir(parents=True, exist_ok=True)
        write_jsonl(model_dir / "responses.jsonl", [{"prompt": p, "response": r, "score": s}
                                                    for p, r, s in zip(prompts, texts, scores[name])])
        _write_json(model_dir / "summary.json", summaries[name])
    if len(paths) == 1:
        return summaries[name]
    names = list(responses)
    plot_score_histograms(scores, output_dir / "score_histograms.png")
    comparison: dict[str, Any] = {"models": dict(zip(names, paths)), "summaries": summaries, "pairs": {}}
    for other in names[1:]:
        plot_score_scatter(scores[names[0]], scores[other], names[0], other, output_dir / f"scatter_{names[0]}_vs_{other}.png")
        difference = np.asarray(scores[other]) - np.asarray(scores[names[0]])
        comparison["pairs"][f"{other}_vs_{names[0]}"] = {
            "model": other, "baseline": names[0], "mean_score_difference": float(difference.mean()),
            "fraction_model_higher": float(np.mean(difference > 0))}  # model minus baseline, prompt by prompt
    _write_json(output_dir / "comparison.json", comparison)
    return comparison


def _env_tasks(config: EvaluateConfig) -> list[dict[str, Any]]:
    """The tasks of env's episodes: `num_samples` 'eval' records of the dataset (a library's own, reasoning_gym:SPEC
    or a SkyRL dataset file, or any marlhf dataset), drawn with `seed`."""
    records = library_records(config.dataset, "eval", env=config.env, seed=config.seed, max_samples=config.num_samples)
    if records is None:
        from marlhf.data import load_records

        records = load_records(config.dataset, "eval", task=config.dataset_task, seed=config.seed,
                               max_samples=config.num_samples)
    return records


def _episodes(config: EvaluateConfig, records: list[dict[str, Any]] | None, device: torch.device) -> dict[str, Any]:
    """Episodes of `config.env` played by the policy, one per task (`samples_per_prompt` with pass_at_k), each
    from its own seed: the summary (marlhf.evaluation.episodes) in summary.json, each episode in episodes.jsonl.
    Without tasks, episode i's environment draws its task from seed + i."""
    if records is None and config.dataset is not None:
        records = _env_tasks(config)
    if records is not None and not records:
        raise ValueError("no evaluation records")
    output_dir = _output_dir(config)
    policy, tokenizer = _load_policy(config.model_name_or_path, config.dtype, device)
    count = config.num_samples if records is None else len(records)
    result = evaluate_episodes(config.env, policy, tokenizer, seeds=[config.seed + i for i in range(count)],
                               tasks=records, env_options=config.env_options,
                               samples_per_task=config.samples_per_prompt if config.pass_at_k else 1,
                               ks=config.pass_at_k or (), success_at=config.success_at,
                               temperature=config.temperature, top_k=config.top_k, top_p=config.top_p,
                               batch_size=config.batch_size, options=config.multi_turn)
    write_jsonl(output_dir / "episodes.jsonl", result.pop("per_episode"))
    _write_json(output_dir / "summary.json", result)
    return result


def _pass_at_k(config: EvaluateConfig, records: list[dict[str, Any]], generation: dict[str, Any],
               device: torch.device, output_dir: Path) -> dict[str, Any]:
    """APPS pass@k of the policy's programs, run against each record's unit tests."""
    prompts = [r["prompt"] for r in records]
    torch.manual_seed(config.seed)
    policy, tokenizer = _load_policy(config.model_name_or_path, config.dtype, device)
    programs = generate_texts(policy, tokenizer, prompts, samples_per_prompt=config.samples_per_prompt,
                              temperature=config.temperature, **generation)
    result = apps_pass_at_k(records, programs, config.pass_at_k, timeout_s=config.code_timeout_s)
    write_jsonl(output_dir / "programs.jsonl", [{"prompt": p, "difficulty": r["difficulty"], "programs": s}
                                                for p, r, s in zip(prompts, records, programs)])
    _write_json(output_dir / "pass_at_k.json", result)
    return result


def _best_of_n(config: EvaluateConfig, path: str, prompts: list[str], generation: dict[str, Any],
               device: torch.device, output_dir: Path) -> dict[str, Any]:
    ns = sorted(config.best_of_n)
    policy, tokenizer = _load_policy(path, config.dtype, device)
    reward_model, rm_tokenizer = _load_reward_model(config.reward_model, config.dtype, device)
    columns = []
    for temperature in config.best_of_n_temperatures:
        torch.manual_seed(config.seed)
        samples = generate_texts(policy, tokenizer, prompts, samples_per_prompt=ns[-1], temperature=temperature,
                                 **generation)
        flat = reward_model_scores(reward_model, rm_tokenizer, [p for p in prompts for _ in range(ns[-1])],
                                   [s for row in samples for s in row], batch_size=config.batch_size,
                                   max_prompt_length=config.max_prompt_length,
                                   max_length=config.max_prompt_length + config.max_response_length)
        columns.append(best_of_n_table(np.asarray(flat).reshape(len(prompts), ns[-1]), ns))
    table = {"n": ns, "temperatures": list(config.best_of_n_temperatures),
             "mean_best_score": [list(row) for row in zip(*columns)], "num_prompts": len(prompts)}
    _write_json(output_dir / "best_of_n.json", table)
    (output_dir / "best_of_n.md").write_text(best_of_n_markdown(table))
    plot_best_of_n(table, output_dir / "best_of_n.png")
    return table
