"""echo: cheap asynchronous RL post-training with rollouts on rented GPUs.

This package holds what every process shares: configs, wire codecs, task adapters, CLI
plumbing and run planning. Modules that need torch import it themselves, so the rest stays light.
"""

__version__ = "0.1.0"
