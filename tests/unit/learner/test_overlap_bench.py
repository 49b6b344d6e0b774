"""`echo-rl bench overlap`'s verdict: the measured knee against each rule's, from run rows."""

import math

from learner.bench.overlap import knees


def row(S, N, bubble, overlapped, paper):
    return {"S": S, "I": max(1, S - 1), "N": N, "bubble_measured": bubble,
            "r_req": {"overlapped": overlapped, "paper": paper}}


def test_knees_are_the_smallest_pool_below_ten_percent_and_each_rules_smallest_sufficient_pool():
    rows = [row(2, 1, 0.70, 700, math.inf), row(2, 2, 0.30, 760, math.inf), row(2, 3, 0.08, 740, math.inf),
            row(3, 1, 0.40, 420, 600), row(3, 2, 0.05, 400, 620), row(3, 3, 0.04, 410, 610)]
    by_s = {k["S"]: k for k in knees(rows, rate=250)}
    assert by_s[2]["measured"] == 3 and by_s[2]["overlapped"] == 3 and by_s[2]["paper"] is None
    assert by_s[3]["measured"] == 2 and by_s[3]["overlapped"] == 2 and by_s[3]["paper"] == 3
    never = knees([row(4, 1, 0.5, 100, 100), row(4, 2, 0.2, 100, 100)], rate=250)[0]
    assert never["measured"] is None and never["largest_n"] == 2 and never["overlapped"] == 1
