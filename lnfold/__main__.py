"""`python -m lnfold`: the `lnfold` command."""
import sys

from .onnx_rewrite.cli import main

sys.exit(main())
