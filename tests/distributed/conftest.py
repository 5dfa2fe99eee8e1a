"""Make the helper module `parity` importable by tests and by the ranks they spawn."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
