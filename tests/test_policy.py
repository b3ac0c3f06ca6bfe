"""The retention policy (``ckptctl.tiering.policy``), as restic tests its ``ApplyPolicy``:

* a table of policies against generated histories, each compared with a golden JSON file
  under ``tests/golden/gc/`` (the history itself is written there too, so a reviewer reads
  one file); ``CKPTCTL_UPDATE_GOLDEN=1 pytest tests/test_policy.py`` rewrites them —
  review the diff by eye before committing;
* hypothesis properties of the invariants: kept + removed = all, disjoint; the newest
  committed, pinned ones, pack bases, young incomplete ones and unreadable ones are kept;
  the decision does not depend on input order; adding a rule never removes more.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.errors import UsageError
from ckptctl.tiering.policy import (COMMITTED, Item, Policy, apply_policy, format_duration,
                                newest_first, parse_duration)

GOLDEN = Path(__file__).parent / "golden" / "gc"
UPDATE = os.environ.get("CKPTCTL_UPDATE_GOLDEN") == "1"
T0 = dt.datetime(2026, 3, 1, tzinfo=dt.timezone.utc).timestamp()
HOUR = 3600.0


# ----------------------------------------------------------------------------- histories

def steady() -> list[Item]:
    """A healthy run: a sealed checkpoint every 500 steps, one every 45 minutes, for 30
    hours; two carry the ``release`` tag."""
    return [Item(f"step-{s}", s, T0 + i * 0.75 * HOUR, "sealed",
                 tags=("release",) if s in (5000, 15000) else ())
            for i, s in enumerate(range(500, 20500, 500))]


def messy() -> list[Item]:
    """What a cron job meets: irregular saves over a week, framework checkpoints without
    a manifest (complete), crashed writes (incomplete, old and young), corrupt ones (one
    superseded by newer committed ones, one not), one that cannot be read here (unknown),
    pins, and names that carry no step."""
    rng = random.Random(7)
    items, t = [], T0
    for i in range(30):
        t += rng.choice([0.2, 0.5, 1, 3, 7, 20]) * HOUR
        s = 1000 * (i + 1) + rng.choice([0, 0, 0, 13])
        state = "sealed" if i % 3 else "complete"
        if i in (4, 17):
            state = "incomplete"
        if i == 11:
            state = "corrupt"
        if i == 22:
            state = "unknown"
        items.append(Item(f"step-{s}", s, round(t), state, pinned=i in (2, 17),
                          tags=("release",) if i == 9 else ()))
    items.append(Item("step-31000", 31000, round(t + 0.4 * HOUR), "incomplete"))  # being written
    items.append(Item("step-32000", 32000, round(t - 10 * HOUR), "corrupt"))  # unreadable here
    items.append(Item("final", None, round(t - 50 * HOUR), "sealed"))
    items.append(Item("scratch", None, None, "complete"))
    return items


def packs() -> list[Item]:
    """Full checkpoints every 5000 steps and delta packs in between, each pack against the
    previous checkpoint (a chain), one an hour."""
    items = []
    for i, s in enumerate(range(1000, 21000, 1000)):
        base = None if s % 5000 == 0 else f"id-{s - 1000}"
        if s == 1000:
            base = None
        items.append(Item(f"step-{s}", s, T0 + i * HOUR, "sealed", id=f"id-{s}", base=base))
    return items


HISTORIES = {"steady": steady, "messy": messy, "packs": packs}

POLICIES = {
    "last-3": {"last": 3},
    "every-5000": {"every": 5000},
    "within-6h": {"within": "6h"},
    "hourly-4": {"hourly": 4},
    "daily-3": {"daily": 3},
    "tag-release": {"tags": ["release"]},
    "last-2-every-5000-daily-2": {"last": 2, "every": 5000, "daily": 2},
    "within-1d-tag-release": {"within": "1d", "tags": ["release"]},
}
NOW_AFTER = 0.5 * HOUR  # "now" is half an hour after the newest item
GRACE = HOUR


def _now(items):
    return max(i.time for i in items if i.time is not None) + NOW_AFTER


def _iso(t):
    return None if t is None else dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime(
        "%Y-%m-%d %H:%M")


def _history_rows(items) -> list[str]:
    """One readable line per item, newest first, for the golden file."""
    rows = []
    for i in newest_first(items):
        flags = [f for f, on in (("pinned", i.pinned), (f"tags={','.join(i.tags)}", i.tags),
                                 (f"id={i.id}", i.id), (f"base={i.base}", i.base)) if on]
        rows.append(f"{i.name:<11} step={i.step!s:<6} {_iso(i.time) or '-':<16} "
                    f"{i.state:<10} {' '.join(flags)}".rstrip())
    return rows


def _golden_doc(name: str) -> dict:
    items = HISTORIES[name]()
    now = _now(items)
    doc = {"history": _history_rows(items), "now": _iso(now), "grace": format_duration(GRACE),
           "policies": {}}
    for pname, table in POLICIES.items():
        d = apply_policy(items, Policy.from_dict(table), now=now, grace=GRACE)
        doc["policies"][pname] = {"policy": table, **d.to_dict()}
    return doc


@pytest.mark.parametrize("history", sorted(HISTORIES))
def test_golden(history):
    path = GOLDEN / f"{history}.json"
    got = _golden_doc(history)
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(path.read_text())
    assert got["history"] == want["history"], "the generator changed: regenerate and review"
    for pname in POLICIES:
        assert got["policies"][pname] == want["policies"][pname], pname
    assert set(want["policies"]) == set(POLICIES)


@pytest.mark.parametrize("history", sorted(HISTORIES))
@pytest.mark.parametrize("pname", sorted(POLICIES))
def test_table_invariants(history, pname):
    """restic's own checks on every row of the table."""
    items = HISTORIES[history]()
    d = apply_policy(items, Policy.from_dict(POLICIES[pname]), now=_now(items), grace=GRACE)
    assert len(d.keep) + len(d.remove) == len(items)
    assert all(d.keep.values())
    assert set(d.keep).isdisjoint(d.remove)


# --------------------------------------------------------------- hand-checked semantics

def test_last_counts_committed_only_and_newest_by_step():
    items = [Item("step-3", 3, 30, "incomplete"), Item("step-2", 2, 20, "sealed"),
             Item("step-1", 1, 50, "complete"), Item("step-0", 0, 0, "corrupt")]
    d = apply_policy(items, Policy(last=2), now=10_000, grace=100)
    assert d.keep == {"step-2": ["last 2", "newest committed"], "step-1": ["last 2"]}
    assert d.remove == ["step-3", "step-0"]  # both older than the grace period


def test_every_keeps_lowest_step_of_each_block():
    items = [Item(f"s{s}", s, s, "sealed") for s in (4000, 4999, 5000, 7500, 9999, 10001, 12000)]
    d = apply_policy(items, Policy(every=5000), now=20_000)
    assert [n for n, r in d.keep.items() if "every 5000 steps" in r] == ["s10001", "s5000",
                                                                           "s4000"]


def test_within_is_relative_to_the_newest_not_now():
    """A run that stalled for a month keeps its last day (restic's rule)."""
    items = [Item(f"c{h}", h, T0 + h * HOUR, "sealed") for h in range(48)]
    d = apply_policy(items, Policy(within=parse_duration("1d")), now=T0 + 30 * 24 * HOUR)
    assert sorted(n for n, r in d.keep.items() if "within 1d" in r) == \
        sorted(f"c{h}" for h in range(23, 48))


def test_hourly_and_daily_take_the_newest_of_each_utc_bucket():
    items = [Item(f"c{m}", m, T0 + m * 60, "sealed") for m in range(0, 300, 20)]  # 5 hours
    d = apply_policy(items, Policy(hourly=3), now=T0 + 6 * HOUR)
    assert [n for n, r in d.keep.items() if "hourly checkpoint" in r] == ["c280", "c220", "c160"]
    d = apply_policy(items, Policy(daily=3), now=T0 + 6 * HOUR)
    assert [n for n, r in d.keep.items() if "daily checkpoint" in r] == ["c280"]


def test_rails_whatever_the_policy():
    items = [Item("new", 9, 900, "sealed"), Item("pinned", 1, 100, "corrupt", pinned=True),
             Item("young", 10, 950, "incomplete"), Item("old", 8, 10, "incomplete"),
             Item("unk", 2, 5, "unknown"), Item("base", 3, 300, "sealed", id="B"),
             Item("pack", 4, 400, "sealed", id="P", base="B", tags=("keep",))]
    d = apply_policy(items, Policy(tags=("keep",)), now=1000, grace=100)
    assert d.keep == {"young": ["incomplete, younger than grace"], "new": ["newest committed"],
                      "pack": ["tag keep"], "base": ["base of kept pack"], "unk": ["state unknown"],
                      "pinned": ["pinned"]}
    assert d.remove == ["old"]


def test_corrupt_is_removed_only_once_superseded():
    """A reader that cannot parse what a newer framework wrote must not lose the run."""
    items = [Item(f"step-{s}", s, s, "corrupt") for s in (1, 2, 3)]
    d = apply_policy(items, Policy(last=1), now=1e9, grace=1)
    assert d.remove == [] and set(d.keep) == {"step-1", "step-2", "step-3"}
    items.append(Item("step-2.5", 2.5, 2.5, "sealed"))
    d = apply_policy(items, Policy(last=1), now=1e9, grace=1)
    assert d.keep["step-3"] == ["corrupt, newer than the newest committed"]
    assert d.remove == ["step-2", "step-1"]


def test_each_series_keeps_its_own():
    """Two runs under one root: each keeps its newest and its last N, whatever the steps."""
    items = [Item(f"big/step-{s}", s, s, "sealed", series="big") for s in (100, 200, 300)]
    items += [Item(f"small/step-{s}", s, s, "sealed", series="small") for s in (1, 2)]
    d = apply_policy(items, Policy(last=1), now=1000)
    assert d.keep == {"big/step-300": ["last 1", "newest committed"],
                      "small/step-2": ["last 1", "newest committed"]}
    assert d.remove == ["big/step-200", "big/step-100", "small/step-1"]


def test_base_chain_is_kept_transitively():
    d = apply_policy(packs(), Policy(last=1), now=T0 + 100 * HOUR)
    assert d.keep == {"step-20000": ["last 1", "newest committed"]}  # a full one: no base
    items = packs()[:-1]  # the newest is now step-19000, a pack 4 deep into its chain
    d = apply_policy(items, Policy(last=1), now=T0 + 100 * HOUR)
    assert d.keep == {"step-19000": ["last 1", "newest committed"],
                      "step-18000": ["base of kept step-19000"],
                      "step-17000": ["base of kept step-18000"],
                      "step-16000": ["base of kept step-17000"],
                      "step-15000": ["base of kept step-16000"]}


def test_empty_policy_is_refused():
    with pytest.raises(UsageError, match="empty policy"):
        apply_policy(steady(), Policy(), now=T0)
    assert Policy(tags=()).is_empty and not Policy(tags=("x",)).is_empty


@pytest.mark.parametrize("table, key", [
    ({"lastt": 1}, "unknown key 'lastt'"), ({"last": 0}, "keep last"),
    ({"last": True}, "keep last"), ({"every": "5000"}, "keep every"),
    ({"within": "30x"}, "not a duration"), ({"tags": 3}, "keep tags"),
    ({"daily": -1}, "keep daily"), ([], "keep must be a table")])
def test_from_dict_names_the_bad_key(table, key):
    with pytest.raises(UsageError) as e:
        Policy.from_dict(table, where="ckptctl.toml: tier warm")
    assert key in str(e.value) and str(e.value).startswith("ckptctl.toml: tier warm: ")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, seconds", [("30d", 30 * 86400), ("1h30m", 5400), ("2w", 1209600),
                                           ("45s", 45), ("0.5h", 1800), ("3600", 3600)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["", "d", "30 d", "1h-5m", "-1h", "inf", "nan", "1x", "y5"])
def test_bad_durations(text):
    with pytest.raises(UsageError, match="not a duration"):
        parse_duration(text)


# -------------------------------------------------------------------------- properties

_STATES = ("sealed", "complete", "incomplete", "corrupt", "unknown")


@st.composite
def histories(draw):
    n = draw(st.integers(0, 25))
    ids = [f"id{k}" for k in range(6)]
    items = []
    for k in range(n):
        items.append(Item(
            f"c{k}",
            draw(st.none() | st.integers(0, 50_000)),
            draw(st.none() | st.floats(T0 - 10 * 86400, T0, allow_nan=False)),
            draw(st.sampled_from(_STATES)),
            pinned=draw(st.booleans()),
            tags=tuple(draw(st.sets(st.sampled_from(["a", "b"])))),
            id=draw(st.none() | st.sampled_from(ids)),
            base=draw(st.none() | st.sampled_from(ids)),
            series=draw(st.sampled_from(["", "", "run2"]))))
    return items


policies = st.builds(
    Policy, last=st.none() | st.integers(1, 6), every=st.none() | st.integers(1, 20_000),
    within=st.none() | st.floats(60, 20 * 86400), hourly=st.none() | st.integers(1, 6),
    daily=st.none() | st.integers(1, 6),
    tags=st.lists(st.sampled_from(["a", "b", "c"]), max_size=2, unique=True).map(tuple),
).filter(lambda p: not p.is_empty)

graces = st.floats(0, 3 * 86400)


@settings(max_examples=300, deadline=None)
@given(histories(), policies, graces, st.randoms(use_true_random=False))
def test_invariants(items, policy, grace, rnd):
    now = T0 + 3600
    d = apply_policy(items, policy, now=now, grace=grace)
    names = {i.name for i in items}
    assert set(d.keep) | set(d.remove) == names and not set(d.keep) & set(d.remove)
    assert len(d.keep) + len(d.remove) == len(items)
    assert all(d.keep.values())  # every kept one says why
    for series in {i.series for i in items}:
        mine = [i for i in newest_first(items) if i.state in COMMITTED and i.series == series]
        if mine:
            assert mine[0].name in d.keep  # every series keeps its newest
        if mine and policy.last:
            assert all(i.name in d.keep for i in mine[:policy.last])
    committed = [i for i in newest_first(items) if i.state in COMMITTED]
    for i in items:
        if i.pinned or i.state == "unknown":
            assert i.name in d.keep
        if i.state in ("incomplete", "corrupt") and (i.time is None or now - i.time < grace):
            assert i.name in d.keep
        newer = [c for c in committed if c.series == i.series and newest_first([i, c])[0] is c]
        if i.state == "corrupt" and not newer:
            assert i.name in d.keep  # nothing committed supersedes it
        if i.name in d.keep and i.base:
            for b in items:
                if b.id == i.base and b.state in COMMITTED:
                    assert b.name in d.keep, (i, b)
    # order of the input does not matter
    shuffled = list(items)
    rnd.shuffle(shuffled)
    assert apply_policy(shuffled, policy, now=now, grace=grace) == d


def _max(a, b):
    return b if a is None else a if b is None else max(a, b)


@settings(max_examples=200, deadline=None)
@given(histories(), policies, policies, graces)
def test_adding_a_rule_never_removes_more(items, p, q, grace):
    """p plus q's rules (larger counts and windows, more tags) keeps all p keeps."""
    now = T0 + 3600
    both = Policy(last=_max(p.last, q.last), every=p.every or q.every,
                  within=_max(p.within, q.within), hourly=_max(p.hourly, q.hourly),
                  daily=_max(p.daily, q.daily), tags=tuple(sorted(set(p.tags) | set(q.tags))))
    kept_p = set(apply_policy(items, p, now=now, grace=grace).keep)
    kept_both = set(apply_policy(items, both, now=now, grace=grace).keep)
    assert kept_p <= kept_both
