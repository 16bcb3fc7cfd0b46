"""`harts` command line (placeholder until the compiler-core work lands)."""
import sys


def main(argv=None) -> int:
    print("harts: not implemented yet", file=sys.stderr)
    return 1
