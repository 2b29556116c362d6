"""Run N local ranks of one command the way `mlx.launch --backend ring` does, bounded by
a timeout, so a test never hangs.

Each rank gets MLX_RANK and MLX_HOSTFILE (a JSON list, per rank, of "ip:port" it
listens on), which is all the ring backend reads. Why not call mlx.launch itself: in
mlx 0.32.4 its per-rank I/O thread selects on the child's always-writable stdin with a
zero timeout, so every rank costs a spinning launcher thread; on a 2-core machine that
makes a launch several times slower (measured: 15 s vs 2.5 s to import mlx_lm;
`benchmarks/distributed.py --mlx-launch`: decode 4-5x slower).
"""

import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RankResult:
    returncode: Optional[int]  # None: still running at the timeout, then killed
    stdout: str
    stderr: str


def free_ports(n: int) -> List[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def start_ranks(command: Sequence[str], n: int = 2, env: Optional[Dict[str, str]] = None) -> "Ranks":
    """Start `command` as ranks 0..n-1; their output goes to files (see Ranks)."""
    workdir = Path(tempfile.mkdtemp(prefix="ranks_"))
    hostfile = workdir / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(n)]))
    base = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **(env or {}))
    if n > 1:  # one rank runs alone, as mlx.launch starts it (no ring to join)
        base["MLX_HOSTFILE"] = str(hostfile)
    processes = []
    for rank in range(n):
        with open(workdir / f"{rank}.out", "w") as out, open(workdir / f"{rank}.err", "w") as err:
            processes.append(subprocess.Popen(list(command), cwd=ROOT, stdout=out, stderr=err,
                                              stdin=subprocess.DEVNULL, env=dict(base, MLX_RANK=str(rank))))
    return Ranks(processes, workdir)


class Ranks:
    def __init__(self, processes: List[subprocess.Popen], workdir: Path):
        self.processes, self.workdir = processes, workdir

    def stderr(self, rank: int) -> str:
        return (self.workdir / f"{rank}.err").read_text()

    def wait(self, timeout: float, stop_others_on_failure: bool = True) -> List[RankResult]:
        """Wait for every rank; one that exits non-zero stops the others (as mlx.launch
        does) unless `stop_others_on_failure` is False; at the timeout every rank still
        running is killed (its returncode is None)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            if stop_others_on_failure and any(p.poll() not in (None, 0) for p in self.processes):
                for p in self.processes:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.05)
        codes = [p.poll() for p in self.processes]
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.wait()
        return [RankResult(code, (self.workdir / f"{rank}.out").read_text(), self.stderr(rank))
                for rank, code in enumerate(codes)]


def run_ranks(command: Sequence[str], n: int = 2, timeout: float = 60.0, stop_others_on_failure: bool = True,
              env: Optional[Dict[str, str]] = None) -> List[RankResult]:
    """Start `command` as ranks 0..n-1 and wait for all (Ranks.wait)."""
    return start_ranks(command, n, env).wait(timeout, stop_others_on_failure)
