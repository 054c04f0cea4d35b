"""``python -m ops.sim``: the simulator without the ``persys-scheduler`` command (manual use)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ops.sim.cli import add_sim_arguments, run_sim

if __name__ == "__main__":  # pragma: no cover - manual use; the CLI is ops/cli.py
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _parser = argparse.ArgumentParser(prog="python -m ops.sim")
    add_sim_arguments(_parser)
    sys.exit(asyncio.run(run_sim(_parser.parse_args())))
