"""Parallel training wrappers built on mpidist.collectives and mpidist.nn."""

from .ddp import DDP

__all__ = ["DDP"]
