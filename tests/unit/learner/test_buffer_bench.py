"""`echo-rl bench buffer` runs, and what it shows holds at a small size: the learner's arrays take
a fraction of what Python lists of the same numbers took."""

import re
import subprocess
import sys


def test_arrays_take_a_fraction_of_the_lists():
    # A process of its own: tracemalloc counts every thread's allocations, and a thread another
    # test left running (a server, a loop) once made the arrays read over 12 bytes/token here.
    out = subprocess.run([sys.executable, "-c", "import sys; from learner.bench.buffer_memory import cli; "
                          "sys.exit(cli(['--groups', '32', '--samples', '4', '--tokens', '2048']))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    arrays = float(re.search(r"arrays \(echo-learner\)\s+(\d+)\s+([\d.]+)", out.stdout).group(2))
    lists = float(re.search(r"Python lists\s+(\d+)\s+([\d.]+)", out.stdout).group(2))
    assert arrays < 12 and lists > 4 * arrays, out.stdout  # bytes per token: 8 is the floor
