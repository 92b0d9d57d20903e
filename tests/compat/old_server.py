"""Run `kvservice serve` of commit a063a55 from the zip on PYTHONPATH, and nothing of today's install.

    PYTHONPATH=tests/fixtures/compat/kvservice-a063a55.zip python tests/compat/old_server.py serve ...
"""

import runpy
import sys

# Today's editable install answers imports the zip lacks (its finder comes after the path): remove it.
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
sys.argv[0] = "kvservice"
runpy.run_module("kvservice.cli", run_name="__main__")
