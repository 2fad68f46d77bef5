"""runner: a declarative, YAML-driven training runner for causal language models."""

__version__ = "0.1.0"
