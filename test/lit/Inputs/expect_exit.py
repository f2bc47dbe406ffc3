"""`expect_exit.py N COMMAND...`: run COMMAND (stdin, stdout and stderr pass through) and exit 0
when it exits with status N, else 1 with a note on stderr. lit's `not` only tells zero from
non-zero; GEIR's tools promise 1 for bad input and 2 for bad usage, and tests check which."""

import subprocess
import sys


def main() -> int:
    if len(sys.argv) < 3 or not sys.argv[1].lstrip("-").isdigit():
        print("usage: expect_exit.py STATUS COMMAND...", file=sys.stderr)
        return 2
    want = int(sys.argv[1])
    got = subprocess.call(sys.argv[2:])
    if got != want:
        print(f"expect_exit: {sys.argv[2]} exited with status {got}, expected {want}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
