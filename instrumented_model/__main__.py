"""``python -m instrumented_model ...`` is ``python -m instrumented_model.train ...``."""
import sys

from .train import main

sys.exit(main())
