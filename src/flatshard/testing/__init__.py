"""Test helpers: a multi-process gloo harness and small reference models."""

from flatshard.testing.harness import DistributedTestError, find_free_port, spawn

__all__ = ["DistributedTestError", "find_free_port", "spawn"]
