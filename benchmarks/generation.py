"""Generation options side by side: seconds to sample a batch with each hf-engine option, and whether the
responses are identical to the default's.

The policy and tokenizer of ppo_step.py (a ~5M-parameter Llama, 4,096-word vocabulary, random weights), a batch
of prompts of `--prompt-lengths` tokens (default 32-64), `--new-tokens` sampled tokens. Options: `sampling_noise` (row_generators: one torch
generator per row; counter_hash: one batched hash for all rows) and `kv_cache` (dynamic; static; static_compiled,
whose compilation happens in the untimed first call). The options
run in alternating rounds (the machine's noise hits all of them alike); the median and min of the rounds are
printed with each option's median over the first's (one generator per row, dynamic cache: generate_responses'
defaults, and PPO's). Exactness: each option's responses against those of the
same noise with the dynamic cache (counter_hash samples other, equally distributed, tokens than row_generators).
`--profile`: where one default generate call spends its time: the model's forward calls against the rest of
`generate` (its Python loop, logits processors, stop checks), and the heaviest torch operators.
`--engine vllm`: the vllm rollout engine (marlhf.engines.vllm; run in the vLLM venv, docs/vllm.md) against the hf
engine's default on the same model and prompts, in alternating rounds; its LLM is built in the untimed first call
(build time printed). The two draw other (equally distributed) tokens, so compare tokens/s: generated tokens
(up to each row's EOS) per second at the median and at the best round (steadier on a busy machine).
The libraries' own output (vLLM's logging and warnings, transformers') is silenced as by the `marlhf` command,
unless `--verbose`.

    python benchmarks/generation.py [--engine hf|vllm] [--batch 16] [--new-tokens 64] [--prompt-lengths 32 64]
                                    [--rounds 5] [--threads 1] [--profile] [--kv-cache-gib 1] [--verbose]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch
from ppo_step import VOCAB_SIZE, llama, word_tokenizer

from marlhf.cli import quiet_libraries
from marlhf.data.encoding import pad_sequences
from marlhf.engines.hf import generate_responses

VLLM = ("vllm engine", "vllm's")
OPTIONS = [("row_generators", "dynamic"), ("row_generators", "static"), ("row_generators", "static_compiled"),
           ("counter_hash", "dynamic"), ("counter_hash", "static")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-lengths", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"),
                        help="prompt lengths in tokens, drawn uniformly (the paper's PPO shape: 32 256)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--profile", action="store_true", help="also profile one default generate call")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="hf: the hf engine's options; vllm: the vllm engine against the hf default")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="vllm on CPU: VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--verbose", action="store_true", help="show vLLM's and transformers' own output")
    args = parser.parse_args()
    quiet_libraries(args.verbose)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = word_tokenizer()
    policy = llama(tokenizer, seed=0).to(device).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randint(*args.prompt_lengths))]
               for _ in range(args.batch)]
    prompt_ids, prompt_mask = pad_sequences(prompts, tokenizer.pad_token_id, "left")
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.bool().to(device)
    sampling = dict(max_new_tokens=args.new_tokens, temperature=0.7, top_k=0, top_p=1.0,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    row_seeds=list(range(args.batch)))

    engine = None
    if args.engine == "vllm":
        from marlhf.engines import EngineContext, VLLMOptions, make_engine

        engine = make_engine("vllm", EngineContext(options=VLLMOptions(kv_cache_gib=args.kv_cache_gib)))
        engine.sync_weights(policy)
    options = OPTIONS if engine is None else [OPTIONS[0], VLLM]

    def sample(noise: str, cache: str) -> tuple[float, torch.Tensor, int]:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        if (noise, cache) == VLLM:
            generation = engine.generate(prompt_ids, prompt_mask, **sampling)
            response_ids, response_mask = generation.response_ids, generation.response_mask
        else:
            response_ids, response_mask = generate_responses(policy, prompt_ids, prompt_mask, sampling_noise=noise,
                                                             kv_cache=cache, **sampling)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, response_ids, int(response_mask.sum())

    responses, tokens = {}, {}
    for option in options:  # also the warm-up (and the vLLM build)
        first_seconds, responses[option], tokens[option] = sample(*option)
        if option == VLLM:
            print(f"vllm engine: first call (LLM build + generate) {first_seconds:.1f} s")
    seconds: dict[tuple[str, str], list[float]] = {option: [] for option in options}
    for _ in range(args.rounds):
        for option in options:
            seconds[option].append(sample(*option)[0])
    where = "cuda" if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    print(f"generation, batch {args.batch}, prompts {args.prompt_lengths[0]}-{args.prompt_lengths[1]} tokens, "
          f"{args.new_tokens} new tokens, {where}, {args.rounds} alternating rounds")
    print(f"{'sampling_noise':<16}{'kv_cache':<17}{'median s':>10}{'min s':>8}{'vs first':>12}{'tokens/s':>10}"
          f"{'best':>7}  same tokens as")
    default = statistics.median(seconds[options[0]])
    for noise, cache in options:
        median = statistics.median(seconds[noise, cache])
        best, count = min(seconds[noise, cache]), tokens[noise, cache]
        if (noise, cache) == VLLM:
            same = "(another random stream)"
        else:
            equal = torch.equal(responses[noise, cache], responses[noise, "dynamic"])
            same = f"{noise}+dynamic: {'yes' if equal else 'NO'}"
        print(f"{noise:<16}{cache:<17}{median:>10.3f}{best:>8.3f}{median / default:>11.2f}x"
              f"{count / median:>10.0f}{count / best:>7.0f}  {same}")
    if args.profile:
        profile(policy, lambda: sample(*OPTIONS[0]))


def profile(policy: torch.nn.Module, generate) -> None:
    """Share of the model's forward calls in one generate call (timed around `policy.forward`), then the
    functions and torch operators with the most self time under cProfile."""
    forward_seconds = [0.0]
    forward = policy.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            forward_seconds[0] += time.perf_counter() - start

    policy.forward = timed_forward
    try:
        total = generate()[0]
    finally:
        del policy.forward  # back to the class's method
    print(f"profile of one {OPTIONS[0][0]}+{OPTIONS[0][1]} call: {total:.3f} s, model forward {forward_seconds[0]:.3f} s "
          f"({forward_seconds[0] / total:.0%}), the rest of generate {total - forward_seconds[0]:.3f} s "
          f"({1 - forward_seconds[0] / total:.0%})")
    profiler = cProfile.Profile()  # torch.profiler's own overhead inflates the cache's many small copies
    profiler.enable()
    generate()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, calls, self time, cumulative, callers)
    rows = sorted(((self_time, calls, name) for (_, _, name), (calls, _, self_time, _, _) in stats.items()),
                  reverse=True)
    everything = sum(row[0] for row in rows)
    print("heaviest functions by self time (share of the call):")
    for self_time, calls, name in rows[:6]:
        print(f"  {name:<48}{self_time:>8.3f} s {self_time / everything:>6.0%}  {calls} calls")


if __name__ == "__main__":
    main()
