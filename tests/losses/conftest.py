"""Make the helper modules beside these tests (NumPy references, batch builders) importable under any
pytest import mode."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
