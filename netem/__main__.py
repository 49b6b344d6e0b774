"""`python -m netem`: see `netem.scenario` for the commands."""

from .scenario import cli

if __name__ == "__main__":
    raise SystemExit(cli())
