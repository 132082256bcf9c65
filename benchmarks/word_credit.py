"""Which word does a macro action's advantage credit? A diagnostic of the segment value weightings.

    python benchmarks/word_credit.py [--work bench_credit_assignment] [--responses 1536] [--epochs 30]

On the demo task (task1 of benchmarks/credit_assignment.py, same SFT model), with the gold reward (x4) as the
only reward: sample responses from the SFT policy and take two critics: one fitted (SFT backbone, fresh head)
to the Monte Carlo returns of half of them, and an *oracle* that knows the reward's structure: the value
before token t is 4/W x (scores of the words already complete + the mean score, over all sampled words, of
the words that begin with the current word's tokens so far + the mean word score for every word slot
still to come). On the other half of the responses, compute macro GAE (gamma 1, lambda 0.95: the study's) for
the segmentations n = 1, n = 5 and word, under each value weighting. For every macro action tau it compares
the advantage A_tau with the gold credit that belongs to it: c_tau = 4/W x the scores of the words that end
inside tau (a word's score is known once its last token is out), and with the next action's c_{tau+1}.
Prints per cell the correlation of A with c_tau (own credit: higher is better), with c_{tau+1} (credit of
the next action leaking back: should be near 0) and the regression slope of A on c_tau (1 = the action gets
its whole credit). Every number comes from this run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import credit_assignment  # noqa: E402  (the study's task and models)

SEGMENTATIONS = ("n1", "n5", "word")
WEIGHTINGS = ("equal", "unit", "position", "first")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="bench_credit_assignment", help="the study's work directory (models)")
    parser.add_argument("--responses", type=int, default=1536, help="responses sampled from the SFT policy")
    parser.add_argument("--epochs", type=int, default=30, help="critic regression epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    arguments = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(arguments.seed)

    from marlhf.advantages import macro_gae
    from marlhf.demo.pipeline import load_models, max_response_tokens
    from marlhf.data.encoding import pad_sequences
    from marlhf.modeling import ScalarHeadModel
    from marlhf.engines.hf import generate_responses
    from marlhf.rollout import response_values
    from marlhf.segments import fixed_ngram, word_starts, words

    work = Path(arguments.work)
    config = credit_assignment.demo_config("task1", "gold_sft", arguments.quick)
    credit_assignment.ensure_models(work / "models" / "task1", config, "task1")
    models = load_models(config, work / "models" / "task1")
    task, tokenizer = models.task, models.tokenizer
    num_words = task.config.num_words
    scale = credit_assignment.GOLD_SCALE / num_words

    # ---- responses of the SFT policy, and each word's score at the token that ends it ------------------
    prompts = [r["prompt"] for r in task.prompts(arguments.responses, seed=3)]
    batches = []
    for start in range(0, len(prompts), 64):
        batch_prompts = prompts[start:start + 64]
        prompt_ids, prompt_mask = pad_sequences([tokenizer(p)["input_ids"] for p in batch_prompts],
                                              tokenizer.pad_token_id, "left")
        with torch.no_grad():
            response_ids, response_mask = generate_responses(
                models.sft, prompt_ids, prompt_mask.bool(), max_new_tokens=max_response_tokens(num_words),
                temperature=0.8, top_k=50, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
        batches.append((prompt_ids, prompt_mask.bool(), response_ids, response_mask))

    def word_credit(response_ids, response_mask):
        """[B, T] float: 4/W x the score of each word (of the first W) on its last token; 0 elsewhere."""
        ids = words(response_mask, word_starts(response_ids, tokenizer) & response_mask)
        credit = torch.zeros(response_mask.shape, dtype=torch.float32)
        for b in range(ids.shape[0]):
            text = tokenizer.decode(response_ids[b][response_mask[b]], skip_special_tokens=True)
            scores = task.word_scores(text)
            row = ids[b].tolist()
            ends = [t for t in range(len(row)) if row[t] >= 0 and (t + 1 == len(row) or row[t + 1] != row[t])]
            word_ends = [t for t in ends if response_ids[b, t].item() not in tokenizer.all_special_ids]
            for score, t in zip(scores, word_ends):
                credit[b, t] = scale * score
        return credit

    credits = [word_credit(r, m) for (_, _, r, m) in batches]
    returns = [c.sum(1) for c in credits]
    gold_check = np.mean([task.gold_reward(tokenizer.decode(r[m], skip_special_tokens=True))
                          for (_, _, rr, mm) in batches[:1] for r, m in zip(rr, mm)])
    half = len(batches) // 2
    train, test = list(range(half)), list(range(half, len(batches)))

    # ---- a critic fitted to the Monte Carlo returns (gamma 1: the return of every state is the total) --------
    critic = ScalarHeadModel.from_pretrained(models.sft_dir)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-3)
    critic.train()
    for epoch in range(arguments.epochs):
        for i in np.random.default_rng(epoch).permutation(train):
            values = response_values(critic, *batches[i])
            mask = batches[i][3]
            target = returns[i][:, None].expand_as(values)
            loss = ((values - target) ** 2)[mask].mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    critic.eval()

    # ---- the oracle critic: word-prefix means of the word scores ----------------------------------------
    def word_pieces(b_ids, b_mask):
        """Per word of a row (special tokens left out): its token ids, first position and score."""
        ids = words(b_mask[None], word_starts(b_ids[None], tokenizer) & b_mask[None])[0]
        n = int(b_mask.sum())
        pieces, start = [], 0
        for t in range(1, n + 1):
            if t == n or ids[t] != ids[t - 1]:
                tokens = tuple(b_ids[start:t].tolist())
                if not set(tokens) & set(tokenizer.all_special_ids):
                    pieces.append((tokens, start))
                start = t
        scores = task.word_scores(tokenizer.decode(b_ids[b_mask], skip_special_tokens=True))
        return [(tokens, start, score) for (tokens, start), score in zip(pieces, scores + [0.0] * len(pieces))]

    rows_pieces = [[word_pieces(r[b], m[b]) for b in range(r.shape[0])] for (_, _, r, m) in batches]
    prefix_sum: dict[tuple, float] = {}
    prefix_count: dict[tuple, int] = {}
    for row in (p for batch_pieces in rows_pieces for p in batch_pieces):
        for tokens, _, score in row[:num_words]:
            for k in range(len(tokens)):
                prefix_sum[tokens[:k]] = prefix_sum.get(tokens[:k], 0.0) + score
                prefix_count[tokens[:k]] = prefix_count.get(tokens[:k], 0) + 1
    mean_score = prefix_sum[()] / prefix_count[()]

    def oracle_values(i):
        _, _, response_ids, mask = batches[i]
        values = torch.zeros(mask.shape)
        for b, row in enumerate(rows_pieces[i]):
            done = 0.0
            for index, (tokens, start, score) in enumerate(row[:num_words]):
                for k in range(len(tokens)):
                    key = tokens[:k]
                    expected = prefix_sum[key] / prefix_count[key]
                    values[b, start + k] = scale * (done + expected + (num_words - index - 1) * mean_score)
                done += score
            n = int(mask[b].sum())
            tail = row[num_words][1] if len(row) > num_words else n
            values[b, tail:n] = scale * done  # past the W-th word (EOS, unread words): nothing more to come
        return values

    # ---- advantages of every segmentation and weighting against the credit that belongs to each action ------
    rows = []
    with torch.no_grad():
        critics = {"fitted": [response_values(critic, *batches[i]) for i in test],
                   "oracle": [oracle_values(i) for i in test]}
    explained = {}
    for name, held_values in critics.items():
        residual = torch.cat([(returns[i][:, None] - v)[batches[i][3]] for i, v in zip(test, held_values)])
        spread = torch.cat([returns[i][:, None].expand_as(v)[batches[i][3]] for i, v in zip(test, held_values)])
        explained[name] = 1 - residual.var().item() / spread.var().item()
    for (critic_name, held_values), segmentation, weighting in (
            (c, s, w) for c in critics.items() for s in SEGMENTATIONS for w in WEIGHTINGS):
            own, nxt, adv = [], [], []
            for i, values in zip(test, held_values):
                _, _, response_ids, mask = batches[i]
                if segmentation == "word":
                    segment_ids = words(mask, word_starts(response_ids, tokenizer))
                else:
                    segment_ids = fixed_ngram(mask, int(segmentation[1:]))
                rewards = torch.where(mask, credits[i], 0.0)
                # Rewards on the last token only, as in PPO: the total at the end.
                terminal = torch.zeros_like(rewards)
                lengths = mask.sum(1)
                terminal[torch.arange(len(lengths)), (lengths - 1).clamp(min=0)] = returns[i]
                advantages, _ = macro_gae(terminal, values, mask, segment_ids, 1.0, 0.95, weighting)
                for b in range(mask.shape[0]):
                    n = int(lengths[b])
                    ids = segment_ids[b, :n]
                    segments = int(ids.max()) + 1 if n else 0
                    seg_credit = torch.zeros(segments).scatter_add(0, ids, rewards[b, :n])
                    first = torch.zeros(segments, dtype=torch.long).scatter_reduce(
                        0, ids, torch.arange(n), "amin", include_self=False)
                    seg_adv = advantages[b, first]
                    own += seg_credit.tolist()
                    nxt += torch.cat([seg_credit[1:], torch.zeros(1)]).tolist()
                    adv += seg_adv.tolist()
            own, nxt, adv = map(np.array, (own, nxt, adv))
            # Own and next credit are nearly independent draws, so one two-variable fit separates them.
            design = np.stack([own, nxt, np.ones_like(own)], axis=1)
            slope, slope_next, _ = np.linalg.lstsq(design, adv, rcond=None)[0]
            rows.append({"critic": critic_name, "segmentation": segmentation, "weighting": weighting,
                         "corr_own": float(np.corrcoef(adv, own)[0, 1]), "corr_next": float(np.corrcoef(adv, nxt)[0, 1]),
                         "slope_own": float(slope), "slope_next": float(slope_next), "actions": int(adv.size)})
    print(f"SFT responses {arguments.responses} (critic fitted on {half * 64}), SFT gold {gold_check:.3f}; share of "
          f"the return variance the critic explains on held-out token states: fitted {explained['fitted']:.2f}, "
          f"oracle {explained['oracle']:.2f}")
    print(f"{'critic':>7} {'segments':>9} {'weighting':>9} {'corr(A, own)':>13} {'corr(A, next)':>14} "
          f"{'slope on own':>13} {'slope on next':>14}")
    for row in rows:
        print(f"{row['critic']:>7} {row['segmentation']:>9} {row['weighting']:>9} {row['corr_own']:>13.3f} "
              f"{row['corr_next']:>14.3f} {row['slope_own']:>13.3f} {row['slope_next']:>14.3f}")
    print(json.dumps({"word_credit": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
