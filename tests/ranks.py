"""Run N local ranks of one command the way `mlx.launch --backend ring` does, bounded by
a timeout, so a test never hangs.

Each rank gets MLX_RANK and MLX_HOSTFILE (a JSON list, per rank, of "ip:port" it
listens on), which is all the ring backend reads. Why not call mlx.launch itself: in
mlx 0.32.4 its per-rank I/O thread selects on the child's always-writable stdin with a
zero timeout, so every rank costs a spinning launcher thread; on a 2-core machine that
makes a launch several times slower (measured: 15 s vs 2.5 s to import mlx_lm).
`benchmarks/distributed.py` shows the same numbers through mlx.launch.
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


def run_ranks(command: Sequence[str], n: int = 2, timeout: float = 60.0, stop_others_on_failure: bool = True,
              env: Optional[Dict[str, str]] = None) -> List[RankResult]:
    """Start `command` as ranks 0..n-1 and wait for all. A rank that exits non-zero stops
    the others (as mlx.launch does) unless `stop_others_on_failure` is False; at the
    timeout every rank still running is killed (its returncode is None)."""
    workdir = Path(tempfile.mkdtemp(prefix="ranks_"))
    hostfile = workdir / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(n)]))
    base = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **(env or {}))
    if n > 1:  # one rank runs alone, as mlx.launch starts it (no ring to join)
        base["MLX_HOSTFILE"] = str(hostfile)
    processes, logs = [], []
    for rank in range(n):
        out, err = open(workdir / f"{rank}.out", "w"), open(workdir / f"{rank}.err", "w")
        logs.append((out, err))
        processes.append(subprocess.Popen(list(command), cwd=ROOT, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, env=dict(base, MLX_RANK=str(rank))))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
        if stop_others_on_failure and any(p.poll() not in (None, 0) for p in processes):
            for p in processes:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.05)
    codes = [p.poll() for p in processes]
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait()
    results = []
    for rank, (out, err) in enumerate(logs):
        out.close()
        err.close()
        text = (workdir / f"{rank}.out").read_text(), (workdir / f"{rank}.err").read_text()
        results.append(RankResult(codes[rank], *text))
    return results
