"""Command line: `marlhf COMMAND [--option value ...]` (also `python -m marlhf`).

The trainers `sft`, `reward`, `dpo`, `ppo` and `evaluate` build their config from a YAML file (`--config`) and
the flags (flags win), then run, reading their records through marlhf.data.load_records(--dataset); a trainer
module is imported only when its command runs. The tools `plot`, `judge`, `human-eval` (marlhf.evaluation) and
`demo` (the embedded demo) and `vllm-serve` (the rollout server of rollout_engine='vllm_server') take their own flags. `marlhf COMMAND --help` lists every option with its default.

The console shows marlhf's own progress bars and messages; the libraries' (transformers' "Loading weights",
datasets' and the Hub's bars, their info messages and deprecation warnings) are silenced unless `--verbose`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import signal
import sys
import threading
import traceback
import typing
import warnings

from marlhf.demo.command import DEMO
from marlhf.envs_command import ENVS_COMMAND
from marlhf.serve_command import VLLM_SERVE
from marlhf.errors import USAGE_EXIT, Interrupted, MissingPackage, OutOfMemory, did_you_mean, one_line
from marlhf.evaluation.commands import TOOLS

# the file-based tools, the embedded demo and the rollout server
TOOLS = {**TOOLS, "demo": DEMO, "vllm-serve": VLLM_SERVE, "envs": ENVS_COMMAND}

# command -> (module, config class, train function, one-line description)
COMMANDS = {
    "sft": ("marlhf.trainers.sft", "SFTConfig", "train_sft", "supervised fine-tuning on prompt/response records"),
    "reward": ("marlhf.trainers.reward", "RewardConfig", "train_reward_model",
               "reward model on preference pairs (Bradley-Terry loss)"),
    "dpo": ("marlhf.trainers.dpo", "DPOConfig", "train_dpo",
            "direct preference optimization against a frozen reference"),
    "ppo": ("marlhf.trainers.ppo", "PPOConfig", "train_ppo",
            "PPO / MA-PPO with macro actions (and the critic-free baselines)"),
    "evaluate": ("marlhf.evaluation.evaluate", "EvaluateConfig", "run_evaluation",
                 "reward-model scores on validation prompts, checkpoint comparison, best-of-N, APPS pass@k"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line, `marlhf: error: COMMAND: ...` (exit 2), as marlhf's own."""

    def error(self, message: str) -> typing.NoReturn:
        command = self.prog.removeprefix("marlhf").strip()
        self.exit(USAGE_EXIT, f"marlhf: error: {command + ': ' if command else ''}{message} "
                              f"(`{self.prog} --help` lists the options)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The top-level parser; only `command`'s subparser gets its options (importing its trainer). Flags are
    never abbreviated (`--learning_rat` is an unknown flag, not `--learning_rate`); `parser.commands` maps each
    command to its subparser."""
    parser = _Parser(prog="marlhf", description="RLHF with macro actions (MA-RLHF).", allow_abbrev=False)
    parser.add_argument("--verbose", action="store_true",
                        help="also show the libraries' progress bars, info messages and warnings (any position)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}
    for name, (module_name, config_name, _, description) in COMMANDS.items():
        subparser = parser.commands[name] = subparsers.add_parser(name, help=description, description=description,
                                                                  allow_abbrev=False)
        if name == command:
            _config_class(parser, module_name, config_name).add_arguments(subparser)
    for name, tool in TOOLS.items():
        subparser = parser.commands[name] = subparsers.add_parser(name, help=tool.description,
                                                                  description=tool.description, allow_abbrev=False)
        tool.add_arguments(subparser)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, with a "did you mean" for each unknown flag from the command's own flags."""
    arguments, unknown = parser.parse_known_args(argv)
    if unknown:
        subparser = parser.commands[arguments.command]
        known = [flag for action in subparser._actions for flag in action.option_strings]
        flags = [word for word in unknown if word.startswith("-")] or unknown
        parser.exit(USAGE_EXIT, f"marlhf: error: {arguments.command}: unrecognized arguments: " + ", ".join(
            f"{flag}{did_you_mean(flag.split('=')[0], known)}" for flag in flags) + "\n")
    return arguments


def _config_class(parser: argparse.ArgumentParser, module_name: str, config_name: str):
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        parser.error(f"{module_name} is not available in this installation")
    return getattr(module, config_name)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_libraries(verbose: bool) -> None:
    """Silence transformers', datasets', DeepSpeed's, vLLM's and the Hub's progress bars, info messages and warnings
    (not errors), unless `verbose`."""
    if verbose:
        return
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # read when datasets is imported
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is imported (the vllm engine's first build)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers.utils.logging as transformers_logging

    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    # DeepSpeed resets its logger's level when imported (Accelerate imports it whenever it is installed); a
    # filter stays.
    logging.getLogger("DeepSpeed").addFilter(_errors_only)
    for module in ("transformers", "accelerate", "datasets", "peft"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=module)
        warnings.filterwarnings("ignore", category=UserWarning, module=module)


def main(argv: list[str] | None = None) -> int:
    """Run a command; the one error boundary of every command. An expected failure prints one line,
    `marlhf: error: <what, where, what to do>`, and returns its class's exit code (marlhf.errors: 2 for bad
    input, 3 a missing optional package, 4 out of memory, 130 Ctrl-C, 143 SIGTERM during a trainer); `--verbose`
    shows its traceback first. Anything else is a bug in marlhf: its traceback, then a line asking for a report,
    exit 1."""
    argv = sys.argv[1:] if argv is None else argv
    verbose = "--verbose" in argv
    argv = [argument for argument in argv if argument != "--verbose"]
    quiet_libraries(verbose)
    started: list = []  # the command's config once it is built: what a stopped run saved
    try:
        return _run(argv, started)
    except (KeyboardInterrupt, Exception) as error:  # sorted into expected failures and bugs
        expected = _expected_failure(error, started[0] if started else None)
        if expected is None:
            traceback.print_exc()
            print(f"marlhf: error: this is a bug in marlhf ({type(error).__name__}), not in your input; please report "
                  "it with the output of the same command run with --verbose", file=sys.stderr)
            return 1
        if verbose:
            traceback.print_exc()
        hint = "" if verbose or isinstance(expected, Interrupted) else " (--verbose shows the traceback)"
        print(f"marlhf: error: {one_line(expected)}{hint}", file=sys.stderr)
        return getattr(expected, "exit_code", USAGE_EXIT)


def _expected_failure(error: BaseException, config) -> BaseException | None:
    """`error` as an expected failure of the user's input or environment (None: a bug). Bad input is a
    ValueError (MarlhfError, or a check's plain ValueError) or an OSError about their files, paths or endpoints;
    Ctrl-C, out-of-memory and a missing optional package become their marlhf.errors classes."""
    if isinstance(error, _Terminated):
        stopped = Interrupted(f"terminated (SIGTERM); {_saved(config)}")
        stopped.exit_code = 128 + signal.SIGTERM  # 143, what a shell reports for `kill PID`: schedulers tell it apart
        return stopped
    if isinstance(error, KeyboardInterrupt):
        return Interrupted(f"interrupted (Ctrl-C); {_saved(config)}")
    if isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError
        what = ". ".join(one_line(error).split(". ")[:2])  # "CUDA out of memory. Tried to allocate 2.00 GiB"
        return OutOfMemory(f"out of memory ({what}){_memory_options(config)}")
    if isinstance(error, ModuleNotFoundError) and error.name and error.name.split(".")[0] != "marlhf":
        return MissingPackage(f"this needs the Python package {error.name.split('.')[0]!r}, which is not installed "
                              f"here: {_install_hint(error.name.split('.')[0])}")
    if isinstance(error, (ValueError, OSError)):  # MarlhfError is a ValueError
        return error
    return None


class _Terminated(KeyboardInterrupt):
    """SIGTERM (`kill PID`, a scheduler's preemption) during a trainer, raised where Ctrl-C's KeyboardInterrupt is."""


def _raise_terminated(signum: int, frame) -> typing.NoReturn:
    raise _Terminated


@contextlib.contextmanager
def _sigterm_as_ctrl_c():
    """SIGTERM stops the body as Ctrl-C does (a KeyboardInterrupt: checkpoints are written atomically, so the
    newest complete one is named with --resume latest) instead of killing the process without a word; the previous
    handler is back afterwards. Python installs handlers in the main thread only, and one installed outside Python
    (getsignal: None) could not be put back: then nothing changes."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _saved(config) -> str:
    """A trainer's newest checkpoint and how to continue; for another command, that it does not resume."""
    if config is None or not hasattr(config, "save_steps"):
        return "this command does not resume: run it again"
    from marlhf.trainers.common import what_was_saved

    return what_was_saved(config)


_MEMORY_OPTIONS = ("per_device_batch_size", "mini_batch_size", "forward_batch_size", "batch_size", "max_length",
                   "max_response_length")  # what the activations grow with


def _memory_options(config) -> str:
    """': lower <the command's batch and length options, with their values>'."""
    values = config.to_dict() if config is not None else {}
    named = [f"{name} ({values[name]})" for name in _MEMORY_OPTIONS if values.get(name) is not None]
    if not named:
        return ": free memory on the device, or use a larger one"
    checkpointing = ", or set gradient_checkpointing" if values.get("gradient_checkpointing") is False else ""
    listed = f"{', '.join(named[:-1])} or {named[-1]}" if len(named) > 1 else named[0]
    return f": lower {listed}{checkpointing}"


def _install_hint(package: str) -> str:
    """The marlhf extra that installs `package` (pyproject's optional dependencies), else pip install it."""
    from importlib import metadata

    try:
        requirements = metadata.requires("marlhf") or []
    except metadata.PackageNotFoundError:
        requirements = []
    for requirement in requirements:
        name, _, marker = requirement.partition(";")
        if "extra ==" in marker and re.split(r"[-=<>~!\[ ]", name.strip())[0].lower() == package.lower():
            extra = marker.split("==")[1].strip(" \"'")
            return f"pip install 'marlhf[{extra}]'"
    return f"pip install {package}"


def _run(argv: list[str], started: list) -> int:
    command = argv[0] if argv and argv[0] in COMMANDS else None
    if command == "ppo":
        from marlhf.trainers.ppo_config import import_named_plugins

        import_named_plugins(argv)
    parser = build_parser(command)
    arguments = _parse(parser, argv)
    if arguments.command in TOOLS:
        return TOOLS[arguments.command].run(arguments)
    module_name, config_name, train_name, _ = COMMANDS[arguments.command]
    config_class = _config_class(parser, module_name, config_name)
    try:
        config = config_class.from_arguments(arguments)
    except ValueError as error:
        parser.exit(USAGE_EXIT, f"marlhf: error: {arguments.command}: {one_line(error)}\n")
    started.append(config)
    from marlhf.modeling import check_model_path

    with _sigterm_as_ctrl_c() if hasattr(config, "save_steps") else contextlib.nullcontext():  # a trainer: resumable
        for name, value in config.to_dict().items():  # a missing model fails before any data is read
            if name.endswith("name_or_path") and isinstance(value, str):
                check_model_path(value)
        getattr(importlib.import_module(module_name), train_name)(config)
    return 0
