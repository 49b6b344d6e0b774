"""Which relays may forward (`broadcast.forwarding`): blame from the pulls a plan did not ask for,
demotion to a leaf, and the learner's publisher acting on both with a relay that forwards nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from aiohttp import web

from broadcast.forwarding import FIRST_LEAF_VERSIONS, FORGIVE_VERSIONS, Forwarding, blamed
from broadcast.relay import PREFIX, Relay
from broadcast.route import Route
from broadcast.transport import Hop
from conftest import worker_pass

MIB = 1 << 20


def route_of(chains, parents=None, spans=None, pull=(), key="v1") -> Route:
    return Route(key=key, root=b"", source=Hop("source", "http://127.0.0.1:9"),
                 chains=tuple(tuple(Hop(w, "http://127.0.0.1:9") for w in c) for c in chains), rates=(None,) * len(chains),
                 spans=None if spans is None else tuple(spans), parents=None if parents is None else tuple(map(tuple, parents)),
                 pull=tuple(pull))


WHOLE = [(0, 8)]


def test_the_nearest_relay_above_the_pulls_that_did_not_pull_is_blamed():
    chain = route_of([["a", "hole", "c", "d"], ["e", "f"]])
    assert blamed(chain, {"c": WHOLE, "d": WHOLE}) == {"hole"}  # everyone below it pulled; it did not
    assert blamed(chain, {"hole": WHOLE, "c": WHOLE, "d": WHOLE}) == {"a"}  # it pulled too: the relay above it
    assert blamed(chain, {"a": WHOLE}) == set() and blamed(chain, {"e": WHOLE, "f": WHOLE}) == set()  # fed by the source
    assert blamed(chain, {}) == set()
    # Stripes: each owner roots one tree's span and is a child in the others; an owner that
    # forwards nothing makes every other member pull its span, and is the only one that did not.
    stripes = route_of([["o1", "o2", "x"], ["o2", "o1", "x"]], parents=[[-1, 0, 0], [-1, 0, 0]], spans=[(0, 4), (4, 8)])
    assert blamed(stripes, {"o1": [(4, 8)], "x": [(4, 8)]}) == {"o2"}
    assert blamed(stripes, {"x": [None]}) == {"o1", "o2"}  # the whole version (under the other key): every tree
    # A member whose parent in a tree is the source pulls that tree's span from it as planned:
    # found in a real run, where a pulling leaf's planned pull of its source-fed span blamed
    # the stripe owner it had pulled nothing from.
    mixed = route_of([["o1", "a", "leaf"], ["a", "o1", "leaf"]], parents=[[-1, 0, 0], [-1, -1, -1]],
                     spans=[(0, 4), (4, 8)], pull=["leaf"])
    assert blamed(mixed, {"leaf": [(4, 8)]}) == set()
    assert blamed(mixed, {"leaf": [(0, 4)]}) == {"o1"}  # it pulled from the source what o1 was to give it


def test_each_blame_doubles_the_versions_a_worker_is_a_leaf_and_a_leaf_cannot_be_blamed():
    f = Forwarding()
    f.planned(route_of([["a", "hole", "c"]], key="v1"))
    f.pulled("v1", "c", 0, 8)
    f.pulled("v0", "c", 0, 8)  # a version with no remembered route: nothing to blame
    assert f.settle(1) == [("hole", 1 + FIRST_LEAF_VERSIONS)]
    assert f.settle(2) == []  # one blame per worker per version, however often it is settled
    assert not f.may_forward("hole", 2) and f.may_forward("hole", 3) and f.may_forward("a", 2)
    f.planned(route_of([["a", "c", "hole", "n"]], parents=[[-1, 0, 1, 1]], pull=["hole", "n"], key="v2"))  # leaves
    f.pulled("v2", "hole", 0, 8)  # on record: no witness
    assert f.settle(2) == []
    f.pulled("v2", "n", 0, 8)
    assert f.settle(2) == [("c", 2 + FIRST_LEAF_VERSIONS)]  # it pulled from the source, not from its parent
    f.planned(route_of([["hole", "a"]], key="v3-d2"))  # the delta's route; the full version's has the others
    f.planned(route_of([["b"]], key="v3"))
    f.pulled("v3", "a", 0, 8)  # missed by the delta's push, it pulls the full version
    assert f.settle(3) == [("hole", 3 + 2 * FIRST_LEAF_VERSIONS)]  # the second blame: twice as long
    assert f.leaves(3) == {"c": 4, "hole": 7} and f.leaves(4) == {"hole": 7} and f.leaves(7) == {}
    f.pulled("v3", "stranger", 0, 8)  # named by no route of the version: not remembered
    assert f.pulls(3) == {"a"} and f.pulls(9) == set()


def test_blames_are_forgotten_after_a_clean_stretch():
    """An honest relay whose link fails once in a while would otherwise reach 64 versions as a
    leaf after six such failures over a week, however rare."""
    f = Forwarding()

    def fail_once(version: int) -> int:
        f.planned(route_of([["flaky", "c"]], key=f"v{version}"))
        f.pulled(f"v{version}", "c", 0, 8)
        [(worker, until)] = f.settle(version)
        assert worker == "flaky"
        return until - version

    assert [fail_once(v) for v in (1, 3, 7)] == [FIRST_LEAF_VERSIONS, 2 * FIRST_LEAF_VERSIONS, 4 * FIRST_LEAF_VERSIONS]
    assert fail_once(7 + FORGIVE_VERSIONS) == 8 * FIRST_LEAF_VERSIONS  # not yet a clean stretch
    assert fail_once(8 + 2 * FORGIVE_VERSIONS) == FIRST_LEAF_VERSIONS  # forgotten: starts again


def test_a_relay_that_acknowledged_a_push_whole_and_pulled_it_anyway_is_blamed_itself():
    """A relay with accepted work swallowed its pushes and pulled each version from the learner:
    walking up from its children's pulls, it passed for a child that pulled too, and nobody was
    blamed for 34 versions (rollouts -40-58%). A member the source pushed a tree to whole has
    no reason to pull it."""
    route = route_of([["hole", "c"]])
    assert blamed(route, {"hole": [None], "c": [None]}) == set()  # as it was: nobody
    assert blamed(route, {"hole": [None], "c": [None]}, {(0, "hole")}) == {"hole"}
    assert blamed(route, {"c": [None]}, {(0, "hole")}) == {"hole"}  # the plain black hole, as before
    deep = route_of([["a", "hole", "c"]])  # the hole fed by a relay, not the source: its parent is blamed
    assert blamed(deep, {"hole": [None], "c": [None]}, {(0, "a")}) == {"a"}
    # Stripes: the source pushed o1 tree 0 and o2 tree 1 whole; o1 swallowed its forward of tree 0
    # and pulled the whole version, its honest co-owner o2 and x repaired tree 0's span (a
    # tester's run demoted o2 too: o1's pull counted against it in tree 1, where o1 is its child).
    stripes = route_of([["o1", "o2", "x"], ["o2", "o1", "x"]], parents=[[-1, 0, 0], [-1, 0, 0]], spans=[(0, 4), (4, 8)])
    owners = {(0, "o1"), (1, "o2")}
    assert blamed(stripes, {"o1": [None], "o2": [(0, 4)], "x": [(0, 4)]}, owners) == {"o1"}
    assert blamed(stripes, {"o2": [(4, 8)]}, owners) == {"o2"}  # its own tree: still its lie
    assert blamed(stripes, {"x": [None]}, owners) == {"o1", "o2"}  # a non-owner's whole pull: every tree, as before
    f = Forwarding()
    f.planned(route_of([["hole", "c"]], key="v1"))
    f.pushed("v1", "hole", 0)
    f.pushed("v1", "stranger", 0)  # named by no route: not remembered
    f.pulled("v1", "hole", 0, 8)
    f.pulled("v1", "c", 0, 8)
    assert f.settle(1) == [("hole", 1 + FIRST_LEAF_VERSIONS)]


def test_a_worker_on_record_for_not_forwarding_is_no_witness_against_its_parents():
    """A black hole, once demoted and then planned as the tail under two honest relays,
    swallowed their pushes and pulled the whole version as its software does: both honest
    parents were demoted, again and again for 400 versions (a tester, 2026-11-28). Its pulls
    now blame nobody until its own blames are forgiven; an honest child's still do."""
    f = Forwarding()
    f.planned(route_of([["hole", "c"]], key="v1"))
    f.pushed("v1", "hole", 0)
    f.pulled("v1", "hole", 0, 8)
    f.pulled("v1", "c", 0, 8)
    assert f.settle(2) == [("hole", 2 + FIRST_LEAF_VERSIONS)]
    f.planned(route_of([["a", "b", "hole"], ["b", "a", "hole"]], parents=[[-1, 0, 1], [-1, 0, 1]],
                       spans=[(0, 4), (4, 8)], key="v5"))
    f.pulled("v5", "hole", 0, 8)  # it pulled the version its parents pushed it
    assert f.settle(6) == []
    assert f.may_forward("a", 6) and f.may_forward("b", 6)
    f.planned(route_of([["a", "c"]], key="v7"))
    f.pulled("v7", "c", 0, 8)  # an honest child's pull is heard as before
    assert f.settle(8) == [("a", 8 + FIRST_LEAF_VERSIONS)]


async def black_hole_relay() -> tuple[web.AppRunner, str]:
    """A relay that takes every push whole, answers 200, and forwards nothing (nor serves pulls)."""
    async def push(request: web.Request) -> web.Response:
        async for _ in request.content.iter_chunked(1 << 16):
            pass
        return web.json_response({"have": 1 << 30})

    app = web.Application()
    app.router.add_post(PREFIX + "/push", push)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_a_relay_that_forwards_nothing_is_a_leaf_in_the_next_plan(tmp_path):
    """The learner's publisher with a relay that swallows its pushes: its children pull v1 from
    the learner, the learner blames it, and v2's plan gives it no children, so v2 reaches the
    others by push. A worker whose work was never accepted has none from the start, and its
    pulls blame nobody."""
    from broadcast.links import MBIT, LinkTable
    from broadcast.signing import SigningKey
    from broadcast.star import BlobStore
    from learner.publisher import ChainPublisher

    rng = np.random.default_rng(5)
    blobs = [rng.integers(0, 256, 3 * MIB, dtype=np.uint8).tobytes() for _ in range(2)]

    async def run():
        links = LinkTable(uplink=40 * MBIT, default=40 * MBIT)
        pub = ChainPublisher(BlobStore(), chunk_bytes=256 << 10, deltas=False, links=links,
                             key_file=tmp_path / "learner.key", host="127.0.0.1")
        await pub.start()
        key = SigningKey.load(tmp_path / "learner.key")
        hole_runner, hole_url = await black_hole_relay()
        relays = {w: Relay(w, key.public_key(), stall_timeout=1, **worker_pass(pub.tickets, w))
                  for w in ("w1", "w2", "new")}
        for r in relays.values():
            await r.start()
        ups = {"hole": 40, "w1": 10, "w2": 1, "new": 40}  # the hole uploads fastest: the planner puts it first
        for w, up in ups.items():
            links.declare(w, down=40 * MBIT, up=up * MBIT)
        urls = {"hole": hole_url, **{w: r.url for w, r in relays.items()}}
        workers = [SimpleNamespace(id=w, relay_url=u, version=-1, reachable=True, groups_accepted=0 if w == "new" else 3)
                   for w, u in urls.items()]
        try:
            await pub.publish(1, blobs[0], workers)
            assert pub.routed == set(urls)  # whom replies tell `on_route` (an idle worker is never passed)
            pub.source.on_pull("v1", "new", 0, 1)  # a pull by a worker with no accepted work blames nobody
            assert "new" not in pub.forwarding.pulls(1)
            # The hole pulls v1 itself, as a tester's did (its children's pulls then passed it by)
            pub.source.on_pull("v1", "hole", 0, pub.source.stores["v1"].manifest.num_chunks)
            got1 = {w: bytes((await r.wait("v1", 30)).data) for w, r in relays.items()}
            pulled1 = {w: [s["by"] for s in r.stores["v1"].stats.spans] for w, r in relays.items()}
            await pub.publish(2, blobs[1], workers)
            got2 = {w: await r.wait("v2", 30) for w, r in relays.items()}
            return got1, pulled1, got2, pub.wire_bytes
        finally:
            for r in relays.values():
                await r.stop()
            await pub.stop()
            await hole_runner.cleanup()

    got1, pulled1, got2, wire = asyncio.run(run())
    plan1, plan2 = wire[1]["plans"]["v1"], wire[2]["plans"]["v2"]

    def has_children(plan, w):
        return any(p == tree.index(w) for tree, parents in zip(plan["chains"], plan["parents"] or
                                                                [range(-1, len(t) - 1) for t in plan["chains"]])
                   if w in tree for p in parents)

    assert has_children(plan1, "hole") and not has_children(plan1, "new"), plan1
    assert plan1["links_mbit"]["new"][1] == 0 and plan1["pull"] == []  # pushed to, uploading to nobody
    assert all(data == blobs[0] for data in got1.values())
    assert any("no push arrived" in by for by in pulled1["w1"] + pulled1["w2"]), pulled1  # it forwarded nothing
    assert wire[1]["demoted"] == {} and wire[2]["demoted"] == {"hole": 2 + FIRST_LEAF_VERSIONS}
    assert not has_children(plan2, "hole") and plan2["links_mbit"]["hole"][1] == 0, plan2
    assert all(bytes(g.data) == blobs[1] for g in got2.values())
    assert all(s["by"] == "push" for w in ("w1", "w2") for s in got2[w].stats.spans), [g.stats.spans for g in got2.values()]


def test_a_record_whose_blames_are_forgotten_is_dropped():
    f = Forwarding()
    f.planned(route_of([["flaky", "c"]], key="v1"))
    f.pulled("v1", "c", 0, 8)
    assert [w for w, _ in f.settle(1)] == ["flaky"] and "flaky" in f.records
    f.settle(1 + FORGIVE_VERSIONS)
    assert "flaky" in f.records  # still within the stretch
    f.settle(2 + FORGIVE_VERSIONS)
    assert f.records == {} and f.may_forward("flaky", 2 + FORGIVE_VERSIONS)


def test_hops_say_where_a_route_placed_a_member():
    """What a link sample may speak of (the learner checks worker samples against it): its
    parents in that version's route, and whether it forwarded; nothing for a key never planned."""
    fwd = Forwarding()
    fwd.planned(route_of([["o1", "o2", "x"], ["o2", "o1", "x"]], parents=[[-1, 0, 0], [-1, 0, 0]],
                         spans=[(0, 4), (4, 8)], key="v7-d6"))
    assert fwd.hops("v7-d6", "o1") == ({"source", "o2"}, True)
    assert fwd.hops("v7-d6", "x") == ({"o1", "o2"}, False)
    assert fwd.hops("v7-d6", "stranger") is None and fwd.hops("v7", "o1") is None
    assert fwd.hops("v91-0", "o1") is None and fwd.hops("made-up", "o1") is None


def test_a_child_that_pulls_what_it_gave_a_receipt_for_is_blamed_not_its_parent():
    """A tail that took its parents' pushes whole and pulled one chunk of each version demoted
    both honest relays 44 times over 1,000 versions once its own record was forgiven (a tester,
    2026-11-28). A parent's report of the push, with the child's receipt, makes the pull the
    child's lie; a report without one makes it a dispute, which blames neither at first and then
    the one of the two in disputes with more workers."""
    f = Forwarding()
    f.planned(route_of([["p1", "framer"]], key="v1"))
    assert f.delivered("v1", "p1", "framer", 0, receipt=True)
    f.pulled("v1", "framer", 0, 1)
    assert f.settle(2) == [("framer", 2 + FIRST_LEAF_VERSIONS)]
    f = Forwarding()
    for v, parent in ((1, "p1"), (2, "p1"), (3, "p2")):  # no receipts: the framer withholds them
        f.planned(route_of([[parent, "framer"]], key=f"v{v}"))
        assert f.delivered(f"v{v}", parent, "framer", 0, receipt=False)
        f.pulled(f"v{v}", "framer", 0, 1)
        demoted = f.settle(v + 1)
        assert demoted == ([] if v < 3 else [("framer", 4 + FIRST_LEAF_VERSIONS)]), (v, demoted)
    assert f.disputes["framer"].keys() == {"p1", "p2"} and f.may_forward("p1", 4) and f.may_forward("p2", 4)
    f.planned(route_of([["p3", "framer"]], key="v4"))  # on record now: its pulls blame nobody
    f.pulled("v4", "framer", 0, 8)
    assert f.settle(5) == []


def test_a_relay_that_claims_pushes_its_children_pulled_is_blamed_by_its_disputes():
    """A black hole that reports pushes it never made, without receipts, disputes with each child
    it starves; each honest child disputes with it alone."""
    f = Forwarding()
    f.planned(route_of([["a", "hole", "c1", "c2"]], parents=[[-1, 0, 1, 1]], key="v1"))
    for child in ("c1", "c2"):
        assert f.delivered("v1", "hole", child, 0, receipt=False)
        f.pulled("v1", child, 0, 8)
    assert f.settle(2) == [("hole", 2 + FIRST_LEAF_VERSIONS)]
    assert not f.delivered("v1", "c1", "hole", 0, receipt=True)  # not above it in the route
    assert not f.delivered("v1", "hole", "stranger", 0, receipt=True) and not f.delivered("v9", "a", "c1", 0, True)
    assert f.delivered("v1", "a", "c2", 0, receipt=True)  # pushed past the failed member: heard
    f.planned(route_of([["o1", "o2", "x"], ["o2", "o1", "x"]], parents=[[-1, 0, 0], [-1, 0, 0]],
                       spans=[(0, 4), (4, 8)], key="v2"))
    assert f.delivered("v2", "o1", "x", 0, True) and not f.delivered("v2", "o2", "x", 0, True)  # siblings there
    assert f.delivered("v2", "o2", "o1", 1, False) and not f.delivered("v2", "o2", "o1", 0, False)
    chain = [f"w{i}" for i in range(1000)]
    f.planned(route_of([chain], key="v3"))
    assert f.delivered("v3", "w0", "w999", 0, True) and not f.delivered("v3", "w999", "w0", 0, True)
    assert not f.delivered("v3", "w500", "w500", 0, True) and not f.delivered("v3", "w1", "w9", 1, True)


def test_a_pull_is_judged_only_after_its_parents_report_could_arrive():
    now = [100.0]
    f = Forwarding(grace_s=6.0, clock=lambda: now[0])
    f.planned(route_of([["p", "framer"]], key="v1"))
    f.pulled("v1", "framer", 0, 1)
    assert f.settle(2) == []  # the parent's heartbeat with its report is still on its way
    f.delivered("v1", "p", "framer", 0, receipt=True)
    now[0] += 6.0
    assert f.settle(3) == [("framer", 3 + FIRST_LEAF_VERSIONS)]


def test_a_framing_child_gets_its_honest_parent_demoted_no_more(tmp_path):
    """The learner's publisher and two real relays, the parent honest: the child takes the push
    whole and then pulls a chunk from the learner, as a tester's framing tail did (its parents
    were demoted 44 times over 1,000 versions). With its receipt in the parent's report, the
    child is the one demoted at the next plan; withholding it (a relay with no receipt key), or
    refusing the push (409) so that no receipt is owed, the parent's word stands against its pull
    and nobody is demoted."""
    from broadcast.links import MBIT, LinkTable
    from broadcast.receipts import receipt_key, valid
    from broadcast.signing import SigningKey
    from broadcast.star import BlobStore
    from learner.publisher import ChainPublisher

    blob = np.random.default_rng(6).integers(0, 256, 2 * MIB, dtype=np.uint8).tobytes()

    class Refuser(Relay):  # a tester's framer of 2026-11-29: no stream taken, so no receipt owed
        async def accept_push(self, reader, peer, identity):
            return 409, "already being pulled"

    async def run(child_signs: bool, refuses: bool = False):
        links = LinkTable(uplink=40 * MBIT, default=40 * MBIT)
        pub = ChainPublisher(BlobStore(), chunk_bytes=256 << 10, deltas=False, links=links,
                             key_file=tmp_path / "learner.key", host="127.0.0.1")
        await pub.start()
        key = SigningKey.load(tmp_path / "learner.key")
        keys = {"parent": receipt_key("parent-secret"), "child": receipt_key("child-secret")}
        relays = {w: (Refuser if refuses and w == "child" else Relay)(
            w, key.public_key(), stall_timeout=1, **worker_pass(pub.tickets, w),
            receipt_key=keys[w] if w == "parent" or child_signs else None) for w in keys}
        for r in relays.values():
            await r.start()
        links.declare("parent", down=40 * MBIT, up=40 * MBIT)
        links.declare("child", down=40 * MBIT, up=1 * MBIT)  # the planner puts it below the parent
        workers = [SimpleNamespace(id=w, relay_url=r.url, version=-1, reachable=True, groups_accepted=3)
                   for w, r in relays.items()]
        try:
            await pub.publish(1, blob, workers)
            if not refuses:
                await relays["child"].wait_settled("v1", 30)
            await relays["parent"].wait_settled("v1", 30)
            reported = relays["parent"].deliveries()
            for version_key, child, tree, presented in reported:  # as the learner's registry hears a heartbeat
                pub.forwarding.delivered(version_key, "parent", child, tree,
                                         receipt=valid(keys[child], presented, version_key, tree, "parent", child))
            pub.source.on_pull("v1", "child", 0, 1)  # the framing pull: one chunk of what it holds
            await pub.publish(2, blob[::-1], workers)
            return reported, pub.wire_bytes[1]["plans"]["v1"], pub.wire_bytes[2]["demoted"]
        finally:
            for r in relays.values():
                await r.stop()
            await pub.stop()

    reported, plan, demoted = asyncio.run(run(child_signs=True))
    assert plan["chains"] == [["parent", "child"]], plan
    assert [(k, c, t) for k, c, t, _ in reported] == [("v1", "child", 0)] and len(reported[0][3]) == 32
    assert demoted == {"child": 2 + FIRST_LEAF_VERSIONS}
    reported, _, demoted = asyncio.run(run(child_signs=False))
    assert [r[3] for r in reported] == [""] and demoted == {}  # one word against another: nobody, not the parent
    reported, _, demoted = asyncio.run(run(child_signs=True, refuses=True))  # refused the push, then pulled
    assert [r[1:] for r in reported] == [("child", 0, "")] and demoted == {}, (reported, demoted)


def test_versions_published_faster_than_the_grace_are_kept_until_their_pulls_are_judged():
    """A version every 1.5 s, children pulling 10.5 s after a version's plan (`fallback_s`), a
    6 s grace: the 8 kept versions were gone before their pulls could be judged, and a black
    hole was blamed 0 times in 200 versions instead of 193 (a tester, 2026-11-29)."""
    now = [0.0]
    f = Forwarding(grace_s=6.0, keep_s=2 * 10.0 + 2 * 6.0, clock=lambda: now[0])  # as the publisher keeps them
    blamed_at = []
    for v in range(1, 41):
        blamed_at += [v for worker, _ in f.settle(v) if worker == "hole"]  # as the publisher: then it plans
        f.planned(route_of([["hole", f"c{v}"]], key=f"v{v}"))
        if v > 7:
            f.pulled(f"v{v - 7}", f"c{v - 7}", 0, 8)  # its child gave up on it and pulled
        now[0] += 1.5
    assert blamed_at and blamed_at[0] <= 7 + 6 / 1.5 + 1, blamed_at


def test_demotions_and_forgiveness_count_published_versions_not_updates():
    """Version numbers count updates; with `[publish] every` = 4 a first demotion "for 2
    versions" ended 2 updates on, before the next plan: the black hole forwarded again at once
    (an API-only tester read the learner's log: v583 → v586, v587 → v592, ...)."""
    f = Forwarding(every=4)
    f.planned(route_of([["a", "hole", "c"]], key="v8"))
    f.pulled("v8", "c", 0, 8)
    assert f.settle(8) == [("hole", 8 + 4 * FIRST_LEAF_VERSIONS)]  # out of the plans of v12 and v16
    assert not f.may_forward("hole", 12) and not f.may_forward("hole", 15) and f.may_forward("hole", 16)
    f.planned(route_of([["a", "hole", "c"]], key=f"v{8 + 4 * FORGIVE_VERSIONS}"))
    f.pulled(f"v{8 + 4 * FORGIVE_VERSIONS}", "c", 0, 8)
    assert f.settle(8 + 4 * FORGIVE_VERSIONS) == [("hole", 8 + 4 * FORGIVE_VERSIONS + 4 * 2 * FIRST_LEAF_VERSIONS)]  # not yet forgotten
