"""HARTS: compile rollout trees so every shared prefix token is computed once, exactly."""

__version__ = "0.1.0"
