"""The library: every verb as a function that returns a result dataclass.

``ops`` never prints; the CLI renders what these return.
"""
from .inspect import InspectResult, inspect, summarize
from .ls import LsResult, ls
from .state import checkpoint_state

__all__ = ["InspectResult", "LsResult", "checkpoint_state", "inspect", "ls", "summarize"]
