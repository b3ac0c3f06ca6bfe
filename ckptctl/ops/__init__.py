"""Every verb as a library call, one import away: ``from ckptctl.ops import verify, promote``.

A face over the domain packages (:mod:`ckptctl.catalog`, :mod:`ckptctl.integrity`,
:mod:`ckptctl.convert`, :mod:`ckptctl.packs`, :mod:`ckptctl.tiering`, :mod:`ckptctl.service`)
that holds no code of its own; nothing inside ckptctl imports it.

>>> from ckptctl.ops import promote, reshard
>>> promote.__module__, reshard.__module__
('ckptctl.tiering.promote', 'ckptctl.convert.reshard')

Names are imported on first use, not with the package: a command pays only for the verb
it runs (``ckptctl latest`` needs neither numpy nor the conversions). Every verb returns a
result dataclass and never prints; the CLI renders what these return.
"""
from __future__ import annotations

import importlib

#: public name -> the module (under ckptctl) that defines it
_EXPORTS = {
    **dict.fromkeys(["ConsolidateResult", "consolidate"], "convert.consolidate"),
    **dict.fromkeys(["DiffResult", "EntryDiff", "diff"], "convert.diff"),
    **dict.fromkeys(["Group"], "writing.distributed"),
    **dict.fromkeys(["InspectResult", "inspect", "summarize"], "catalog.inspect"),
    **dict.fromkeys(["ReshardResult", "reshard"], "convert.reshard"),
    **dict.fromkeys(["GcResult", "gc"], "tiering.gc"),
    **dict.fromkeys(["LatestResult", "latest"], "tiering.latest"),
    **dict.fromkeys(["LsResult", "ls"], "catalog.ls"),
    **dict.fromkeys(["PackResult", "pack"], "packs.pack"),
    **dict.fromkeys(["UnpackResult", "unpack"], "packs.unpack"),
    **dict.fromkeys(["PinResult", "pin", "unpin"], "tiering.pins"),
    **dict.fromkeys(["Decision", "Item", "Policy", "apply_policy", "parse_duration"], "tiering.policy"),
    **dict.fromkeys(["Measurement", "PlanResult", "TierInput", "measure_tier", "plan",
                     "young_daly"], "tiering.plan"),
    **dict.fromkeys(["PromoteResult", "promote"], "tiering.promote"),
    **dict.fromkeys(["RemoveResult", "remove_checkpoint"], "writing.removal"),
    **dict.fromkeys(["ReportData", "report"], "report"),
    **dict.fromkeys(["remove"], "tiering.rm"),
    **dict.fromkeys(["SealResult", "seal"], "integrity.seal"),
    **dict.fromkeys(["checkpoint_state"], "catalog.state"),
    **dict.fromkeys(["Problem"], "catalog.checks"),
    **dict.fromkeys(["VerifyResult"], "integrity.result"),
    **dict.fromkeys(["TierCheck", "TiersResult", "check_tiers"], "tiering.tiers"),
    **dict.fromkeys(["PROBLEM_CODES", "VerifyAllResult", "verify", "verify_all"],
                    "integrity.verify"),
    **dict.fromkeys(["MeasuredPlan", "measured_plan"], "service.drains"),
    **dict.fromkeys(["WatchPass"], "service.results"),
    **dict.fromkeys(["read_status", "state_dir"], "service.status"),
    **dict.fromkeys(["Watcher", "lower_priority"], "service.watch"),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"ckptctl.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
