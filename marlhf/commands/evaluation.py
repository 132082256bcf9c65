"""The evaluation tools of the `marlhf` command that take files rather than a config: `plot`, `judge`,
`human-eval` (`evaluate` is a config command like the trainers). Heavy imports happen in each tool's `run`."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from marlhf.commands.base import Tool
from marlhf.errors import MarlhfError


def _number(minimum: float, kind: type = float) -> Callable[[str], float]:
    """An argparse type: a finite `kind` >= minimum (argparse names the flag when it refuses one)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expects {kind.__name__}, got {text!r}") from None
        if not value >= minimum or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number >= {minimum}, got {text!r}")
        return value

    return parse


def _plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories holding metrics.jsonl")
    parser.add_argument("--out", default="plots", help="directory for the PNG files (default: plots)")
    parser.add_argument("--label", nargs="+", default=None,
                        help="one label per run; runs with the same label are seeds of one curve "
                             "(default: the name of each run directory's parent)")
    parser.add_argument("--metrics", nargs="+", default=None,
                        help="metric names to draw (default: the known diagnostics the runs logged)")
    parser.add_argument("--smooth", type=_number(1, int), default=1, help="trailing moving-average window in logged steps (default: 1)")


def _run_plot(arguments: argparse.Namespace) -> int:
    from marlhf.evaluation.plots import plot_diagnostics

    for path in plot_diagnostics(arguments.run_dirs, arguments.out, arguments.label, arguments.metrics, arguments.smooth):
        print(path)
    return 0


def _judge_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a", required=True, help="JSONL of prompt/response lines of system A (marlhf evaluate's responses.jsonl)")
    parser.add_argument("--b", required=True, help="JSONL of system B over the same prompts")
    parser.add_argument("--out", required=True, help="JSONL of the judgments; the summary goes to OUT with suffix .summary.json")
    parser.add_argument("--seed", type=int, default=0, help="seed of the order in which the pair is shown (default: 0)")
    judge = parser.add_mutually_exclusive_group(required=True)
    judge.add_argument("--judge-url", help="OpenAI-compatible endpoint, e.g. https://api.openai.com/v1")
    judge.add_argument("--reward-model", help="reward-model checkpoint used as the judge (higher score wins)")
    parser.add_argument("--judge-model", default="gpt-4o", help="model name sent to --judge-url (default: gpt-4o)")
    parser.add_argument("--api-key-env", default=None,
                        help="environment variable holding the API key of --judge-url (default: no key)")
    parser.add_argument("--cache-dir", default=".judge_cache",
                        help="on-disk cache of the endpoint's answers (default: .judge_cache)")
    parser.add_argument("--max-workers", type=_number(1, int), default=4, help="concurrent requests (default: 4)")
    parser.add_argument("--timeout", type=float, default=15.0, metavar="SECONDS",
                        help="total time one request to --judge-url may take, its retries included; the first "
                             "request that gives up ends the run (default: 15)")
    parser.add_argument("--template", default=None,
                        help="text file of the judge's prompt with {prompt}, {first} and {second}, asking for an "
                             "answer of 1, 2 or tie (default: marlhf.evaluation.judge.JUDGE_TEMPLATE)")
    parser.add_argument("--tie-margin", type=_number(0), default=0.0,
                        help="--reward-model: score differences up to this are ties (default: 0)")
    parser.add_argument("--batch-size", type=_number(1, int), default=16, help="--reward-model: scoring batch size (default: 16)")


def _run_judge(arguments: argparse.Namespace) -> int:
    from marlhf.evaluation.judge import (JUDGE_TEMPLATE, ChatJudge, RewardModelJudge, judge_pairwise, load_pairs,
                                         write_jsonl)

    prompts, responses_a, responses_b = load_pairs(arguments.a, arguments.b)
    if arguments.judge_url is not None:
        template = JUDGE_TEMPLATE if arguments.template is None else Path(arguments.template).read_text()
        judge = ChatJudge(arguments.judge_url, arguments.judge_model, api_key_env=arguments.api_key_env,
                          cache_dir=arguments.cache_dir, template=template, max_workers=arguments.max_workers,
                          timeout_s=arguments.timeout)
    else:
        import torch

        from marlhf.evaluation.evaluate import reward_model_scores
        from marlhf.modeling import ScalarHeadModel, load_tokenizer

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        reward_model = ScalarHeadModel.from_pretrained(arguments.reward_model).to(device)
        tokenizer = load_tokenizer(arguments.reward_model)
        judge = RewardModelJudge(lambda p, r: reward_model_scores(reward_model, tokenizer, p, r,
                                                                  batch_size=arguments.batch_size),
                                 tie_margin=arguments.tie_margin)
    judgments, summary = judge_pairwise(prompts, responses_a, responses_b, judge, seed=arguments.seed)
    write_jsonl(arguments.out, judgments)
    Path(arguments.out).with_suffix(".summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


def _human_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a", help="JSONL of prompt/response lines of system A")
    parser.add_argument("--b", help="JSONL of system B over the same prompts")
    parser.add_argument("--out", help="JSONL the choices are appended to (an existing file is resumed)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the side each response is shown on (default: 0)")
    parser.add_argument("--annotator", default="", help="name stored with each choice")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8000, help="port to serve on (default: 8000; 0: any free port)")
    parser.add_argument("--summary", nargs="+", metavar="CHOICES", default=None,
                        help="instead of serving: win rate of one or two choices files and, for two, their agreement")


def _port(text: str) -> int:
    """A TCP port number, 0 to 65535 (argparse names the option on a bad one)."""
    if not text.strip().isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 0 to 65535, got {text!r}")
    return int(text)


def _run_human_eval(arguments: argparse.Namespace) -> int:
    from marlhf.evaluation.human_eval import HumanEvalSession, serve, summarize_choices
    from marlhf.evaluation.judge import load_pairs

    if arguments.summary is not None:
        print(json.dumps(summarize_choices(arguments.summary), indent=2))
        return 0
    if not (arguments.a and arguments.b and arguments.out):
        raise MarlhfError("human-eval: --a, --b and --out are required (or --summary CHOICES...)")
    session = HumanEvalSession(*load_pairs(arguments.a, arguments.b), arguments.out, seed=arguments.seed,
                               annotator=arguments.annotator)
    serve(session, arguments.host, arguments.port)
    return 0


EVALUATION_TOOLS: dict[str, Tool] = {
    "plot": Tool(_plot_arguments, _run_plot,
                 "training diagnostics (reward, KL, advantage/return L2 norms, segment length, repetition) "
                 "from runs' metrics.jsonl, mean and spread over seeds"),
    "judge": Tool(_judge_arguments, _run_judge,
                  "pairwise win/tie/loss of A against B by an OpenAI-compatible judge or a reward model"),
    "human-eval": Tool(_human_eval_arguments, _run_human_eval,
                       "local web page for human pairwise evaluation; --summary: win rate and agreement"),
}
