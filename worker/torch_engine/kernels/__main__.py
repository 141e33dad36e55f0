"""`python -m worker.torch_engine.kernels`: build the engine's CPU kernels now (make install runs it)."""

import sys

from worker.torch_engine.kernels import main

sys.exit(main())
