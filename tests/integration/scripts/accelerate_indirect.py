"""Runs accelerate_wide_mlp.py without importing Accelerate itself, so that nothing in this
file tells which framework trains: ``--framework accelerate`` has to say it."""

import runpy
from pathlib import Path

runpy.run_path(str(Path(__file__).with_name("accelerate_wide_mlp.py")), run_name="__main__")
