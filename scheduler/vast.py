"""Vast.ai through its maintained SDK (`vastai` on PyPI; `pip install 'echo-rl[market]'`).

The calls used, and the HTTP requests the SDK makes for them (what the tests' fake server
answers, tests/vast_fake.py):

    search_offers(query, type, order, limit)   POST   /api/v0/bundles/          {"offers": [...]}
    create_instance(id, image, onstart_cmd…)   PUT    /api/v0/asks/{offer}/     {"success": true, "new_contract": N}
    destroy_instance(id)                       DELETE /api/v0/instances/{id}/   {"success": true}
    show_instances()                           GET    /api/v1/instances/        {"instances": [...], "next_token": null}

An offer row gives the GPU (`gpu_name`, `num_gpus`), `dph_total` ($/h with storage), the
reliability (`reliability2`, else `reliability`), `inet_down`/`inet_up` (Mbit/s),
`inet_down_cost`/`inet_up_cost` ($/GB), `geolocation`, `verification` and, for
interruptible search (`type="bid"`), `min_bid`. An instance row's `actual_status` is
`created`/`loading`/`running`, or `exited`/`offline` once it stopped (an outbid interruptible
one) — `intended_status` says whether we asked for that.
"""

from __future__ import annotations

import os

from scheduler.market import Offer, OfferGone


def _import_sdk():
    try:
        from vastai import VastAI
    except ImportError as e:  # an optional extra: say how to get it
        raise ImportError("[scheduler.provider] type = 'vast' needs the Vast.ai SDK: "
                          "pip install 'echo-rl[market]' (or pip install vastai)") from e
    return VastAI


def parse_offer(row: dict, interruptible: bool = False, bid_margin: float = 0.0) -> Offer:
    """One `/bundles/` row as an `Offer` (an interruptible one is priced at the bid we place)."""
    price = float(row.get("dph_total") or 0.0)
    if interruptible and row.get("min_bid") is not None:
        price = float(row["min_bid"]) * (1 + bid_margin)
    reliability = row.get("reliability2", row.get("reliability"))
    return Offer(
        id=str(row["id"]), gpu=str(row.get("gpu_name", "")), num_gpus=int(row.get("num_gpus") or 1),
        price_per_hour=round(price, 6), reliability=float(reliability if reliability is not None else 0.0),
        down_mbps=float(row.get("inet_down") or 0.0), up_mbps=float(row.get("inet_up") or 0.0),
        dollars_per_gb_down=float(row.get("inet_down_cost") or 0.0),
        dollars_per_gb_up=float(row.get("inet_up_cost") or 0.0),
        location=str(row.get("geolocation") or ""), verified=row.get("verification") == "verified",
        interruptible=interruptible,
    )


def instance_state(row: dict) -> str:
    """'starting' | 'running' | 'stopped' from a `/instances/` row."""
    actual = (row.get("actual_status") or row.get("cur_state") or "").lower()
    if actual == "running":
        return "running"
    if actual in ("exited", "stopped", "offline", "inactive") or (row.get("intended_status") or "") == "stopped":
        return "stopped"
    return "starting"  # None, created, loading, scheduling


class VastMarket:
    name = "vast"

    def __init__(self, *, gpus: dict[str, float], query: str = "", image: str, disk_gb: float = 40.0,
                 interruptible: bool = False, bid_margin: float = 0.1, limit: int = 64, api_url: str = "",
                 api_key: str | None = None, label_prefix: str = "echo"):
        VastAI = _import_sdk()
        self.sdk = VastAI(api_key=api_key if api_key is not None else os.environ.get("VAST_API_KEY"),
                          server_url=api_url or None, raw=True, quiet=True)
        self.gpus, self.image, self.disk_gb = gpus, image, disk_gb
        self.interruptible, self.bid_margin, self.limit = interruptible, bid_margin, limit
        self.label_prefix = label_prefix
        names = " ".join(f"gpu_name={name.replace(' ', '_')}" for name in gpus) if len(gpus) == 1 else \
            "gpu_name in [" + ",".join(name.replace(" ", "_") for name in gpus) + "]"
        self.query = f"{query} {names}".strip()
        self._bids: dict[str, float] = {}

    def search(self) -> list[Offer]:
        rows = self.sdk.search_offers(query=self.query, type="bid" if self.interruptible else "on-demand",
                                      order="dph_total", limit=self.limit)
        offers = [parse_offer(r, self.interruptible, self.bid_margin) for r in rows or []]
        self._bids = {o.id: o.price_per_hour for o in offers}
        return offers

    def create(self, offer: Offer, label: str, onstart: str) -> str:
        import requests

        try:
            reply = self.sdk.create_instance(
                id=int(offer.id), image=self.image, disk=self.disk_gb, label=f"{self.label_prefix}:{label}",
                onstart_cmd=onstart, price=offer.price_per_hour if offer.interruptible else None,
                cancel_unavail=True)
        except requests.HTTPError as e:
            body = e.response.text[:200] if e.response is not None else ""
            status = e.response.status_code if e.response is not None else 0
            if status in (400, 404, 410):
                raise OfferGone(f"HTTP {status}: {body}") from None
            raise
        if not reply.get("success") or not reply.get("new_contract"):
            raise OfferGone(str(reply.get("msg") or reply.get("error") or reply)[:200])
        return str(reply["new_contract"])

    def destroy(self, instance_id: str) -> None:
        import requests

        try:
            self.sdk.destroy_instance(id=int(instance_id))
        except requests.HTTPError as e:
            if e.response is None or e.response.status_code != 404:  # already gone is what we wanted
                raise

    def states(self) -> dict[str, str]:
        rows = self.sdk.show_instances() or []
        return {str(r["id"]): instance_state(r) for r in rows
                if str(r.get("label") or "").startswith(f"{self.label_prefix}:")}
