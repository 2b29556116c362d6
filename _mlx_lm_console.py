"""The console scripts of mlx_lm (setup.py's entry points): each runs a command's `main`.

This module sits outside the package on purpose. Importing `mlx_lm` is what reports a
missing MLX (a ModuleNotFoundError naming what to install), and an entry point inside
the package imports it before any code of ours could catch that, so a user would see
the report as a traceback. From here it is one line on stderr and exit status 1; every
other error propagates as it is. That includes `mlx_lm --help`: the table of commands it
prints lives in the package, and a second copy here would drift from it.
"""

import sys
from importlib import import_module
from typing import Callable


def _command(module: str) -> Callable[[], None]:
    """A console script: import `module` and run its `main` on sys.argv."""

    def run() -> None:
        try:
            command = import_module(module)
        except ModuleNotFoundError as e:
            if e.name != "mlx" and not (e.name or "").startswith("mlx."):
                raise
            sys.exit(str(e))
        command.main()

    return run


main = _command("mlx_lm.cli")
generate = _command("mlx_lm.generate")
convert = _command("mlx_lm.convert")
cache_prompt = _command("mlx_lm.cache_prompt")
server = _command("mlx_lm.server")
fuse = _command("mlx_lm.fuse")
chat = _command("mlx_lm.chat")
benchmark = _command("mlx_lm.benchmark")
