"""The `eaglet` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: eaglet rehearse --configfile FILE [--target-files DIR] [--out DIR]\n"
              "       eaglet status [--results DIR] [--json] [--watch SECONDS]\n"
              "       eaglet plan [--config FILE] [--preset NAME] [--tokens N] [--json]\n"
              "       eaglet speculators DRAFTER_DIR OUT_DIR --target DIR [-k K]\n\n"
              "  status       where a run stands: finished stages and their checks, what runs\n"
              "               now, what remains and how long it will take\n"
              "  plan         memory per stage (extraction, training, disk) estimated from the\n"
              "               target's shape and the config, before a run starts\n"
              "  rehearse     the run's config end to end on a miniature of its target (same\n"
              "               architecture, template and tokenizer, toy widths) in minutes on\n"
              "               the CPU: what would fail, stage by stage, before the real run\n"
              "  speculators  a speculators-format copy of a drafter: `vllm serve OUT_DIR`\n"
              "               serves the target with it, no --speculative-config needed")
        return 0
    if argv[0] == "status":
        from eaglet.status import main as status_main
        return status_main(argv[1:])
    if argv[0] == "rehearse":
        from eaglet.rehearse import main as rehearse_main
        return rehearse_main(argv[1:])
    if argv[0] == "plan":
        from eaglet.plan import main as plan_main
        return plan_main(argv[1:])
    if argv[0] == "speculators":
        return speculators_main(argv[1:])
    print(f"eaglet: unknown command {argv[0]!r}; try `eaglet status`", file=sys.stderr)
    return 2


def speculators_main(argv: list[str]) -> int:
    import argparse

    from eaglet.export import export_speculators
    parser = argparse.ArgumentParser(prog="eaglet speculators")
    parser.add_argument("drafter_dir", help="the exported drafter (e.g. results/drafter)")
    parser.add_argument("out_dir", help="where the speculators-format copy goes")
    parser.add_argument("--target", required=True,
                        help="the target's HF directory or id vLLM serves (e.g. results/target)")
    parser.add_argument("-k", type=int, default=3, help="draft tokens per step (default 3; "
                        "eval/serve.json names the best k per concurrency)")
    args = parser.parse_args(argv)
    export_speculators(args.drafter_dir, args.out_dir, args.target, args.k)
    print(f"wrote {args.out_dir}: serve it with "
          f"python -m vllm.entrypoints.openai.api_server --model {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
