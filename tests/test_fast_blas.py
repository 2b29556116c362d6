"""fast_blas.py: `import mlx_lm` makes MLX's CPU matrix products use MKL on Linux x86_64
(the `cpu` extra installs it), nothing changes silently when it cannot, and the results
equal the reference BLAS's. Each case runs in a fresh interpreter: which BLAS MLX binds
is decided when mlx.core first loads."""

import json
import os
import platform
import subprocess
import sys

import numpy as np

from mlx_lm.fast_blas import OPT_OUT

WITH_MKL = sys.platform.startswith("linux") and platform.machine() == "x86_64"  # where the cpu extra brings it

PRODUCT = """
import json, sys
{first}
import mlx.core as mx
from mlx_lm import fast_blas
a = mx.random.normal((5, 300), key=mx.random.key(1))
b = mx.random.normal((300, 200), key=mx.random.key(2))
product = a @ b
mx.eval(product)
print(json.dumps({{"blas": fast_blas.blas_in_use(), "library": fast_blas.cblas_library(),
                  "product": product.tolist()}}))
"""


def run(first="import mlx_lm", **env):
    """What a fresh interpreter reports after one product: its stdout lines before the
    report, and the report."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("MKL_") and k != OPT_OUT}
    result = subprocess.run([sys.executable, "-c", PRODUCT.format(first=first)], capture_output=True, text=True,
                            timeout=120, env={**inherited, **env}, check=True)
    *before, report = result.stdout.strip().splitlines()
    return before, json.loads(report)


def test_import_mlx_lm_makes_mlx_multiply_with_mkl():
    before, report = run(MKL_VERBOSE="1")
    if WITH_MKL:
        # MKL itself logs the product MLX handed it.
        assert any(line.startswith("MKL_VERBOSE SGEMM(N,N,200,5,300") for line in before), before
        assert "libmkl_rt" in report["library"]
        assert report["blas"].startswith("Intel MKL ") and "(sequential, 1 thread)" in report["blas"]
    else:
        assert report["library"] is None and not before


def test_mkl_threads_can_be_asked_for():
    _, report = run(MKL_NUM_THREADS="2")
    if WITH_MKL:
        assert "(intel, 2 threads)" in report["blas"]


def test_nothing_changes_silently_when_mkl_cannot_take_effect():
    for first, env, reason in [("import mlx.core", {}, "mlx.core was imported before mlx_lm"),
                               ("import mlx_lm", {OPT_OUT: "1"}, f"{OPT_OUT} is set")]:
        _, report = run(first, **env)
        assert report["library"] is None
        if WITH_MKL:
            assert "reference BLAS" in report["blas"] and reason in report["blas"], report["blas"]


def test_mkl_products_equal_the_reference_blas_products():
    _, fast = run()
    _, reference = run(**{OPT_OUT: "1"})
    np.testing.assert_allclose(np.array(fast["product"]), np.array(reference["product"]), rtol=1e-5, atol=1e-5)


def test_the_cli_and_the_server_name_the_blas(tmp_path):
    from pathlib import Path

    from server_harness import start_server

    demo = Path(__file__).resolve().parent.parent / "examples" / "models" / "qwen3-next-stdlib"
    want = "BLAS: Intel MKL" if WITH_MKL else "BLAS: "  # (elsewhere: the platform's, or on a GPU none)
    cli = subprocess.run([sys.executable, "-m", "mlx_lm.generate", "--model", str(demo), "--prompt", "x",
                          "--max-tokens", "2", "--verbose", "true"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0 and (want in cli.stdout or not WITH_MKL), cli.stdout + cli.stderr
    server = start_server("blas", demo, tmp_path / "server.log").wait_ready()
    try:
        assert want in server.log() or not WITH_MKL
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)
