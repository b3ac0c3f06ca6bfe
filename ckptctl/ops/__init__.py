"""The library: every verb as a function that returns a result dataclass.

``ops`` never prints; the CLI renders what these return.
"""
from .consolidate import ConsolidateResult, consolidate
from .diff import DiffResult, EntryDiff, diff
from .inspect import InspectResult, inspect, summarize
from .reshard import ReshardResult, reshard
from .gc import GcResult, gc
from .latest import LatestResult, latest
from .ls import LsResult, ls
from .pack import PackResult, UnpackResult, pack, unpack
from .pins import PinResult, pin, unpin
from .policy import Decision, Item, Policy, apply_policy, parse_duration
from .promote import PromoteResult, promote
from .remove import RemoveResult, remove_checkpoint
from .seal import SealResult, seal
from .state import checkpoint_state
from .tiers import TierCheck, TiersResult, check_tiers
from .verify import PROBLEM_CODES, Problem, VerifyResult, verify

__all__ = ["ConsolidateResult", "ReshardResult", "consolidate", "reshard", "InspectResult", "LsResult", "PROBLEM_CODES", "Problem", "SealResult", "VerifyResult",
           "checkpoint_state", "inspect", "ls", "seal", "summarize", "verify",
           "TierCheck", "TiersResult", "check_tiers", "PromoteResult", "promote",
           "GcResult", "gc", "LatestResult", "latest", "PinResult", "pin", "unpin",
           "Decision", "Item", "Policy", "apply_policy", "parse_duration",
           "RemoveResult", "remove_checkpoint", "DiffResult", "EntryDiff", "diff",
           "PackResult", "UnpackResult", "pack", "unpack"]
