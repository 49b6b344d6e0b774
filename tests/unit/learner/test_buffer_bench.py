"""`echo-rl bench buffer` runs, and what it shows holds at a small size: the learner's arrays take
a fraction of what Python lists of the same numbers took."""

import re

from learner.bench.buffer_memory import cli


def test_arrays_take_a_fraction_of_the_lists(capsys):
    assert cli(["--groups", "32", "--samples", "4", "--tokens", "2048"]) == 0
    out = capsys.readouterr().out
    arrays = float(re.search(r"arrays \(echo-learner\)\s+(\d+)\s+([\d.]+)", out).group(2))
    lists = float(re.search(r"Python lists\s+(\d+)\s+([\d.]+)", out).group(2))
    assert arrays < 12 and lists > 4 * arrays, out  # bytes per token: 8 is the floor
