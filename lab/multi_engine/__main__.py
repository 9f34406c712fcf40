"""python -m lab.multi_engine: lab/multi_engine/demo.py. Its code lives there, not here: the
engines' processes (multiprocessing's spawn) find their entry point by its module's name, and
a spawned process does not import a package's __main__ by name."""

import sys

from lab.multi_engine.demo import run

if __name__ == "__main__":
    sys.exit(run())
