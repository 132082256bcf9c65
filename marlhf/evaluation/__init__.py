"""Evaluation and diagnostics.

- `evaluate`: generate for validation prompts, reward-model scores, checkpoint comparison, best-of-N
- `passk`: unbiased pass@k by APPS difficulty with the sandboxed code reward
- `judge`: pairwise win rates from a reward model or an OpenAI-compatible judge endpoint
- `human_eval`: local web page for human pairwise evaluation, win rate and inter-annotator agreement
- `plots`: training diagnostics from metrics.jsonl (mean and spread over seeds)
- `repetition`: repeated n-gram fraction of generations (a reward-hacking signal): `evaluate` reports word 3-grams
  (`repeated_word_3gram_fraction`), PPO logs token 3-grams (`objective/repetition`)
"""
