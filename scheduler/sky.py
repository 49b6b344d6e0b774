"""SkyPilot: to be written."""


class SkyMarket:
    name = "sky"
