"""The library: every verb as a function that returns a result dataclass.

``ops`` never prints; the CLI renders what these return.

>>> from ckptctl.ops import promote, reshard
>>> promote.__module__, reshard.__module__
('ckptctl.ops.promote', 'ckptctl.ops.reshard')

Names are imported on first use, not with the package: a command pays only for the verb
it runs (``ckptctl latest`` needs neither numpy nor the conversions). A verb and the
module that holds it share a name (``ckptctl.ops.reshard``); the package attribute is
always the verb, as it was when everything was imported eagerly.
"""
from __future__ import annotations

import importlib
import sys
import types

#: public name -> the module (under ckptctl.ops) that defines it
_EXPORTS = {
    **dict.fromkeys(["ConsolidateResult", "consolidate"], "consolidate"),
    **dict.fromkeys(["DiffResult", "EntryDiff", "diff"], "diff"),
    **dict.fromkeys(["Group"], "distributed"),
    **dict.fromkeys(["InspectResult", "inspect", "summarize"], "inspect"),
    **dict.fromkeys(["ReshardResult", "reshard"], "reshard"),
    **dict.fromkeys(["GcResult", "gc"], "gc"),
    **dict.fromkeys(["LatestResult", "latest"], "latest"),
    **dict.fromkeys(["LsResult", "ls"], "ls"),
    **dict.fromkeys(["PackResult", "UnpackResult", "pack", "unpack"], "pack"),
    **dict.fromkeys(["PinResult", "pin", "unpin"], "pins"),
    **dict.fromkeys(["Decision", "Item", "Policy", "apply_policy", "parse_duration"], "policy"),
    **dict.fromkeys(["Measurement", "PlanResult", "TierInput", "measure_tier", "plan",
                     "young_daly"], "plan"),
    **dict.fromkeys(["PromoteResult", "promote"], "promote"),
    **dict.fromkeys(["RemoveResult", "remove_checkpoint"], "remove"),
    **dict.fromkeys(["SealResult", "seal"], "seal"),
    **dict.fromkeys(["checkpoint_state"], "state"),
    **dict.fromkeys(["TierCheck", "TiersResult", "check_tiers"], "tiers"),
    **dict.fromkeys(["PROBLEM_CODES", "Problem", "VerifyAllResult", "VerifyResult", "verify",
                     "verify_all"], "verify"),
    **dict.fromkeys(["MeasuredPlan", "WatchPass", "Watcher", "lower_priority",
                     "measured_plan", "read_status", "state_dir"], "watch"),
}
__all__ = sorted(_EXPORTS)


class _LazyOps(types.ModuleType):
    def __getattr__(self, name: str):
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{self.__name__}.{module}"), name)
        super().__setattr__(name, value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # importing ckptctl.ops.reshard sets the package's ``reshard`` to the module:
        # the verb of that name keeps it (``from ckptctl.ops import reshard`` is the verb)
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_EXPORTS))


sys.modules[__name__].__class__ = _LazyOps
