"""The benchmarks: one entry point (``python -m bench NAME [args]``, ``python -m bench --list``) over shared steps.

``steps`` holds what every benchmark does (MaxText's venv, a step in a fresh process, ckptconv's and MaxText's
converters on a tiny model, the leaf-by-leaf comparison, the results page's head); ``measure`` one tool run measured
from outside (wall, peak RSS, the RSS-over-time samples); ``forward`` MaxText's forward pass and loaders in its
venv. Each benchmark is one module with ``main(argv)``; its results page is under docs/bench/.
"""
