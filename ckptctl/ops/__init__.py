"""The library: every verb as a function that returns a result dataclass.

``ops`` never prints; the CLI renders what these return.
"""
from .consolidate import ConsolidateResult, consolidate
from .inspect import InspectResult, inspect, summarize
from .reshard import ReshardResult, reshard
from .ls import LsResult, ls
from .seal import SealResult, seal
from .state import checkpoint_state
from .verify import PROBLEM_CODES, Problem, VerifyResult, verify

__all__ = ["ConsolidateResult", "ReshardResult", "consolidate", "reshard", "InspectResult", "LsResult", "PROBLEM_CODES", "Problem", "SealResult", "VerifyResult",
           "checkpoint_state", "inspect", "ls", "seal", "summarize", "verify"]
