import sys

from scheduler.bench.planning import cli

sys.exit(cli(sys.argv[1:]))
