"""`echo-rl bench learner --only claims` (table 9) runs and measures what it says: a batch of
stale groups, none of them checked at fraction 0, and the kept version's host memory beside
the share checked (~20 s: three child processes)."""

import json

from learner.bench import trainer as bench


def test_the_claims_table_checks_the_share_it_names(capsys):
    assert bench.cli(["--only", "claims", "--quick", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["claims"]
    assert [r["fraction"] for r in rows] == [0.0, 0.25, 1.0] and not any("error" in r for r in rows)
    off, quarter, every = rows
    assert off["claims_checked"] == 0 and off["kept_bytes"] == 0
    assert quarter["claims_checked"] == every["claims_checked"] == 1  # the quick batch is one group
    # v0, the version claimed, is kept as published (fp32 here): one copy of the weights.
    assert every["kept_bytes"] == 4 * every["params"]
