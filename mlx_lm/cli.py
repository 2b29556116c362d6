"""`mlx_lm <command> ...`: dispatch to the command's own `main`."""

import importlib
import sys

from ._version import __version__

# Command name -> module whose main() parses the remaining arguments.
COMMANDS = {
    "generate": "mlx_lm.generate",
    "convert": "mlx_lm.convert",
    "cache_prompt": "mlx_lm.cache_prompt",
    "server": "mlx_lm.server",
    "fuse": "mlx_lm.fuse",
    "chat": "mlx_lm.chat",
    "benchmark": "mlx_lm.benchmark",
}


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: mlx_lm {{{','.join(COMMANDS)}}} ... | --version")
        sys.exit(0 if argv else 2)
    if argv[0] == "--version":
        print(__version__)
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        sys.exit(f"mlx_lm: unknown command {command!r}; choose from {', '.join(COMMANDS)}")
    sys.argv = [f"mlx_lm.{command}", *rest]
    importlib.import_module(COMMANDS[command]).main(rest)


if __name__ == "__main__":
    main()
