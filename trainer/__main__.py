"""`python -m trainer COMMAND`:

- ``train --config configs/NAME.yaml [key=value ...]``: the main job (gateway, engines and
  trainer on the local machine, or the trainer alone with ``launch.gateway=HOST:PORT``); the config
  is validated before any heavy import, so ``--help`` and a bad key answer at once;
- ``eval --model M --data D [--engine vllm|jax] [--samples k] ...``: pass@k, maj@k and lengths of
  a checkpoint on a benchmark or any JSONL, through the engines the main job starts
  (`trainer.eval.run`); every flag is also a config key (``--config``, ``section.key=value``);
- ``export RUN_DIR[/checkpoints/STEP] OUT_DIR``: a training checkpoint as an HF folder
  (`trainer.eval.export`);
- ``parity``: the model-parity demo on SmolLM2 or any HF folder;
- ``compare RUN_DIR ... --out PNG [--labels A B ...]``: several runs' reward curves and held-out
  accuracies in one plot (`trainer.launch.compare`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="run the main job (gateway, engines, trainer)",
        description="Run the main job. Overrides are section.key=value (e.g. trainer.steps=3 "
        "rollout.backend=jax); run_dir=PATH sets the run folder.",
    )
    train.add_argument("--config", type=Path, required=True, help="YAML config (configs/*.yaml)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    train.add_argument("--log-level", default="WARNING", help="log level of this process")
    _eval_parser(sub)
    export = sub.add_parser("export", help="a training checkpoint as an HF folder")
    export.add_argument(
        "checkpoint", type=Path, help="RUN_DIR (newest) or RUN_DIR/checkpoints/STEP"
    )
    export.add_argument("out_dir", type=Path, help="the HF folder to write")
    export.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run's adapters as a PEFT adapter folder (default: merged into the weights)",
    )
    parity = sub.add_parser("parity", help="JAX vs transformers on one checkpoint")
    parity.add_argument("--model", type=Path, default=None, help="HF folder (default: SmolLM2)")
    parity.add_argument("--prompt", default="What is 17 + 25? Answer with a number.")
    parity.add_argument("--new-tokens", type=int, default=32)
    compare = sub.add_parser("compare", help="several runs' reward curves in one plot")
    compare.add_argument("run_dirs", type=Path, nargs="+", help="run folders (metrics.jsonl)")
    compare.add_argument("--out", type=Path, required=True, help="the PNG to write")
    compare.add_argument("--labels", nargs="*", default=[], help="a legend name per run")
    compare.add_argument("--title", default="", help="the plot's title")
    return parser


# eval flag -> the config key it sets (flags win over --config, overrides win over flags)
EVAL_FLAGS = {
    "model": "model.path",
    "data": "eval.data",
    "engine": "rollout.backend",
    "samples": "eval.samples",
    "temperature": "eval.temperature",
    "max_new_tokens": "eval.max_new_tokens",
    "out": "eval.out_dir",
    "prompt_template": "data.prompt_template",
    "answer_field": "data.answer_field",
    "answer_form": "data.answer_form",
    "answer_regex": "data.answer_regex",
    "limit": "data.limit",
}


def _eval_parser(sub: Any) -> None:
    ev = sub.add_parser(
        "eval",
        help="pass@k / maj@k of a checkpoint on a benchmark or any JSONL",
        description="Evaluate a checkpoint through the engines the main job starts. Each flag "
        "sets a config key (shown in brackets); --config gives any of them, and "
        "section.key=value overrides win over both.",
    )
    ev.add_argument("--config", type=Path, default=None, help="YAML job config (optional)")
    helps = {
        "model": "HF folder, 'smollm2', 'tiny:VARIANT' or RUN_DIR[/checkpoints/STEP]",
        "data": "gsm8k | aime24 | amc23 | minerva (local files) | PATH.jsonl",
        "engine": "vllm | jax",
        "samples": "completions per problem (k of pass@k, maj@k)",
        "temperature": "sampling temperature (0: greedy)",
        "max_new_tokens": "most new tokens per completion",
        "out": "output folder (summary.json, completions.jsonl, logs/)",
        "prompt_template": "str.format template over the row's fields, e.g. '{Body} {Question}'",
        "answer_field": "the row's field holding the gold answer",
        "answer_form": "auto | number | hash | boxed | regex",
        "answer_regex": "the pattern of --answer-form regex",
        "limit": "evaluate the first N problems",
    }
    for name, key in EVAL_FLAGS.items():
        kind = {"samples": int, "max_new_tokens": int, "limit": int, "temperature": float}
        ev.add_argument(f"--{name.replace('_', '-')}", type=kind.get(name, str), default=None,
                        help=f"{helps[name]} [{key}]")  # fmt: skip
    ev.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ev.add_argument("--log-level", default="WARNING", help="log level of this process")


def _eval(args: argparse.Namespace) -> int:
    import yaml

    from trainer.config import ConfigError
    from trainer.launch.job_config import load_job_config

    flags = [
        f"{key}={yaml.safe_dump(getattr(args, name), default_style=chr(39)).strip()}"
        if isinstance(getattr(args, name), str) else f"{key}={getattr(args, name)}"
        for name, key in EVAL_FLAGS.items()
        if getattr(args, name) is not None
    ]  # fmt: skip
    try:
        job = load_job_config(args.config, [*flags, *args.overrides])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from trainer.launch.interrupt import install

    install()  # Ctrl-C and SIGTERM stop every child
    from trainer.eval.run import format_summary, run_eval

    try:
        summary = run_eval(job)
    except (FileNotFoundError, KeyError, ValueError) as err:
        print(f"eval error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


def _train(args: argparse.Namespace) -> int:
    from trainer.config import ConfigError
    from trainer.launch.job_config import load_job_config

    try:
        job = load_job_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    from trainer.launch.interrupt import EXIT_INTERRUPTED, install

    install()  # Ctrl-C and SIGTERM stop every child, even during a long train step
    from trainer.launch.job import error_log, run_job
    from trainer.launch.report import format_summary
    from trainer.user_error import UserError

    try:
        result = run_job(job)
    except UserError as err:  # one or two plain lines; the traceback went to logs/
        print(f"error: {err}", file=sys.stderr)
        print(f"(traceback: {error_log(job.run_dir)})", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every child process was stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_INTERRUPTED)  # do not wait for a train step still running in XLA
    print(format_summary(result))
    print(f"run folder: {job.run_dir} (metrics.jsonl, job_summary.json, tensorboard/, logs/)")
    return int(result.get("exit_code", 0))  # 128 + signal after a graceful SIGINT/SIGTERM stop


def main(argv: list[str] | None = None) -> int:
    """Parses the command line before any heavy import; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "train":
        return _train(args)
    if args.command == "eval":
        return _eval(args)
    if args.command == "export":
        from trainer.eval.export import export_checkpoint

        try:
            print(f"wrote {export_checkpoint(args.checkpoint, args.out_dir, args.adapter)}")
        except (FileNotFoundError, ValueError) as err:
            print(f"export error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "compare":
        from trainer.launch.compare import compare_runs, format_comparison, plot_comparison

        try:
            runs = compare_runs(args.run_dirs, args.labels)
        except ValueError as err:
            print(f"compare error: {err}", file=sys.stderr)
            return 2
        print(format_comparison(runs))
        print(f"plot: {plot_comparison(runs, args.out, args.title)}")
        keys = ("label", "reward_first5", "reward_last5", "reward_ends_steps", "held_out")
        print(json.dumps([{k: r[k] for k in keys} for r in runs]))
        return 0
    if args.command == "parity":
        from models.checkpoints.smollm2 import ensure_smollm2
        from trainer.parity import run_parity

        result = run_parity(args.model or ensure_smollm2(), args.prompt, args.new_tokens)
        print(json.dumps(result, indent=2))
        return 0 if result["same_tokens"] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
