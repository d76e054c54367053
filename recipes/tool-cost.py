"""What bubblewrap costs a call of the Python tool: `tasks.tools.sandboxed_python` of one short
program, in bubblewrap (as found here) and under the audit hook alone (`tools.isolation` replaced),
alternated in one process so that the machine's drift hits both alike; medians and fastest.

    python recipes/tool-cost.py [--calls 20]

Figures: MEASUREMENTS.md, "Tools".
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks import tools  # noqa: E402

CODE = "print(sum(i * i for i in range(1000)))"


def timed_call(isolated):
    """Seconds of one tool call, in bubblewrap or under the hook alone."""
    found, tools.isolation = tools.isolation, (tools.isolation if isolated else lambda: None)
    try:
        start = time.perf_counter()
        out = tools.sandboxed_python(CODE)
        seconds = time.perf_counter() - start
    finally:
        tools.isolation = found
    if out != "332833500":
        raise SystemExit(f"tool-cost.py: the call printed {out!r}")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="calls each way (at least 1)")
    args = parser.parse_args()
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    if tools.isolation() is None:
        raise SystemExit(f"tool-cost.py: no bubblewrap to compare: {tools.isolation_problem()}")
    times = {True: [], False: []}
    for k in range(args.calls):
        for isolated in (True, False) if k % 2 else (False, True):
            times[isolated].append(timed_call(isolated))
    for isolated, name in ((True, "bubblewrap"), (False, "the audit hook alone")):
        print(f"{name:22s} median {statistics.median(times[isolated]) * 1000:4.0f} ms a call, "
              f"fastest {min(times[isolated]) * 1000:4.0f} ms ({args.calls} calls)")


if __name__ == "__main__":
    main()
