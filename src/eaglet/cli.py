"""The `eaglet` command."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: eaglet status [--results DIR] [--json] [--watch SECONDS]\n\n"
              "  status   where a run stands: finished stages and their checks, what runs now,\n"
              "           what remains and how long it will take")
        return 0
    if argv[0] == "status":
        from eaglet.status import main as status_main
        return status_main(argv[1:])
    print(f"eaglet: unknown command {argv[0]!r}; try `eaglet status`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
