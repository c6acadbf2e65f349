"""``python -m ckptconv`` and the ``ckptconv`` command: the CLI, in a fresh process (how Prefect tasks run conversions).

This module imports nothing heavy at its top: :func:`main` sets what must be set before NumPy loads, then loads the CLI.
"""

import os

# OpenBLAS starts one thread per core when NumPy loads, and each spins about 0.1 s waiting for work before it sleeps:
# measured on 2 cores, `inspect` of a tiny checkpoint took 0.42 CPU-s with them and 0.30 with one thread, `convert`
# 0.60 and 0.49 (the wall the same); on a 13-core host that is twelve spinning threads, on a 200-core one 63 (OpenBLAS's
# most). The CLI needs none of them: its parallelism is its own workers (`--workers`), and its one product of
# matrices (a LoRA merge's B @ A, rank 8-64) is small beside the reads. A value already set is kept.
BLAS_THREADS_ENV = {"OPENBLAS_NUM_THREADS": "1"}


def main() -> None:
    for name, value in BLAS_THREADS_ENV.items():
        os.environ.setdefault(name, value)
    from ckptconv.cli import run  # after the environment above: cli imports NumPy

    run()


if __name__ == "__main__":
    main()
