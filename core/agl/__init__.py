"""agl: train any existing AI agent with reinforcement learning."""

__version__ = "0.1.0"
