"""The `eaglet` command line: its subcommands (rehearse, status, plan, speculators, publish), each
of which loads its own modules only when it runs."""

from __future__ import annotations

import contextlib
import io
import sys


def _main_of(command: str):
    """The entry point of a subcommand (imported only when asked for)."""
    if command == "status":
        from eaglet.tools.status.render import main as status_main

        return status_main
    if command == "rehearse":
        from eaglet.tools.rehearse import main as rehearse_main

        return rehearse_main
    if command == "plan":
        from eaglet.tools.plan import main as plan_main

        return plan_main
    if command == "speculators":
        return speculators_main
    if command == "publish":
        return publish_main
    return None


COMMANDS = ("rehearse", "status", "plan", "speculators", "publish")


def usage(command: str) -> str:
    """A subcommand's usage, as its own argument parser prints it: the flags it takes, never
    a copy that falls behind them."""
    text = io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        _main_of(command)(["--help"])
    return text.getvalue().split("\n\n", 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        lines = [usage(command) for command in COMMANDS]  # one "usage:", then aligned
        lines[1:] = [" " * len("usage:") + line.removeprefix("usage:") for line in lines[1:]]
        print(
            "\n".join(lines) + "\n\n"
            "  status       where a run stands: finished stages and their checks, what runs\n"
            "               now, what remains and how long it will take\n"
            "  plan         memory per stage (extraction, training, disk) estimated from the\n"
            "               target's shape and the config, before a run starts\n"
            "  rehearse     the run's config end to end on a miniature of its target (same\n"
            "               architecture, template and tokenizer, toy widths) in minutes on\n"
            "               the CPU: what would fail, stage by stage, before the real run\n"
            "  speculators  a speculators-format copy of a drafter: `vllm serve OUT_DIR`\n"
            "               serves the target with it, no --speculative-config needed\n"
            "  publish      upload an exported drafter and its model card (README.md) to the\n"
            "               Hugging Face Hub\n\n"
            "`eaglet COMMAND --help` explains a command's options."
        )
        return 0
    command = _main_of(argv[0])
    if command is not None:
        return command(argv[1:])
    print(f"eaglet: unknown command {argv[0]!r}; try `eaglet status`", file=sys.stderr)
    return 2


def speculators_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="eaglet speculators")
    parser.add_argument("drafter_dir", help="the exported drafter (e.g. results/drafter)")
    parser.add_argument("out_dir", help="where the speculators-format copy goes")
    parser.add_argument(
        "--target",
        required=True,
        help="the target's HF directory or id vLLM serves (e.g. results/target)",
    )
    parser.add_argument(
        "-k",
        type=int,
        default=3,
        help="draft tokens per step (default 3; eval/serve.json names the best k per concurrency)",
    )
    args = parser.parse_args(argv)
    from eaglet.model.export import export_speculators  # after parsing: --help stays quick

    export_speculators(args.drafter_dir, args.out_dir, args.target, args.k)
    print(
        f"wrote {args.out_dir}: serve it with "
        f"python -m vllm.entrypoints.openai.api_server --model {args.out_dir}"
    )
    return 0


def publish_main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="eaglet publish",
        description="Upload an exported drafter (config.json, model.safetensors and its model "
        "card README.md) to the Hugging Face Hub as REPO_ID, creating the repo. "
        "Needs a token with write access (`hf auth login` or HF_TOKEN) and the "
        "network.",
    )
    parser.add_argument(
        "drafter_dir",
        help="the exported drafter (e.g. results/drafter, or its speculators-format copy)",
    )
    parser.add_argument("repo_id", help="the Hub repo to create or update: OWNER/NAME")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    args = parser.parse_args(argv)
    from eaglet.tools.model_card import PublishError, publish  # after parsing

    try:
        url = publish(args.drafter_dir, args.repo_id, private=args.private)
    except PublishError as exc:
        print(f"eaglet publish: {exc}", file=sys.stderr)
        return 1
    print(
        f"published {args.drafter_dir} as {url} (its README.md serves the drafter from "
        f"{args.repo_id})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
