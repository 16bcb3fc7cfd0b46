"""`python -m harts_compiler.generator ...` = `harts gen ...`."""
import sys

from .cli import gen_main

sys.exit(gen_main(sys.argv[1:]))
