"""``ckptctl plan``: Young/Daly arithmetic checked against hand-computed cases (issues 11
and 21), Daly's higher-order interval and expected-time model (never more than a day lost
per day), the refusal and the warning where the first-order formula does not hold,
--node-mtbf, --write-bandwidth, ``y`` durations, drains and fits (a ceiling or an unknown
rate never "fits"), the per-node bandwidth, local capacity, recovery, parsing, and
``--measure`` at a local tier and a real (rclone) S3 tier, whose probe must be gone."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptctl.tiering.config import Tier
from ckptctl.errors import UsageError
from ckptctl.tiering.plan import (FIRST_ORDER_RATIO, MIN_EFFICIENCY, Measurement, TierInput,
                              checkpoint_size, daly, drains, expected_efficiency,
                              expected_overhead, local_capacity, measure_tier,
                              node_bandwidth, overhead, plan, system_mtbf, young_daly)

YEAR = 365 * 86400

BASE = ("--checkpoint-size", "1TB", "--save-seconds", "60", "--mtbf", "2.8h")


def _doc(cli, *args) -> dict:
    code, out, err = cli("plan", *args, "--json")
    assert code == 0, (code, out, err)
    return json.loads(out)


def _usage(cli, *args) -> str:
    code, out, err = cli("plan", *args)
    assert (code, out) == (2, ""), (code, out, err)
    assert "Traceback" not in err
    return err


def _config(path: Path, *tiers: dict) -> Path:
    lines = []
    for t in tiers:
        lines.append("[[tier]]")
        for k, v in t.items():
            if isinstance(v, dict):
                inner = ", ".join(f"{a} = {json.dumps(b)}" for a, b in v.items())
                lines.append(f"{k} = {{ {inner} }}")
            else:
                lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------ hand-computed cases
def test_the_issues_case_c60_mtbf_2_8h():
    # 2 * 60 * 10,080 = 1,209,600; sqrt = 1,099.818...
    tau = young_daly(60, 2.8 * 3600)
    assert 1099 < tau < 1100 and tau == pytest.approx(1099.8181667894, rel=1e-12)
    # at the optimum both terms are equal: overhead = 2 sqrt(C / (2 M)) = sqrt(120 / 10,080)
    assert overhead(60, tau, 10080) == pytest.approx(math.sqrt(120 / 10080), rel=1e-12)
    assert overhead(60, tau, 10080) == pytest.approx(0.109109, abs=1e-6)


def _daly_eff(c, tau, m):
    """Daly's expected efficiency written out: tau / (M (e^((tau + C)/M) - 1))."""
    return tau / (m * (math.exp((tau + c) / m) - 1))


@pytest.mark.parametrize("c, m, tau, best, chosen, tau_chosen", [
    # e^0.105 = 1.1107106; 0.1 / 0.1107106 = 0.903255; e^0.205 = 1.2275249: 0.879024
    (50, 10_000, 1000.0, 0.096745, 0.120976, 2000),
    # e^0.0202 = 1.0204054: 0.02 / 0.0204054 = 0.980133; e^0.0402 = 1.0410190: 0.975158
    (2, 10_000, 200.0, 0.019867, 0.024842, 400),
    # tau* = sqrt(2,160,000) = 1,469.69; e^0.103333 = 1.1088610: 0.1 / 0.1088610 = 0.918603
    (60, 5 * 3600, math.sqrt(2_160_000), None, 0.081397, 1800),
])
def test_hand_computed_intervals_and_overheads(c, m, tau, best, chosen, tau_chosen):
    r = plan(10**9, c, m, interval_seconds=tau_chosen)
    assert r.optimal_interval_seconds == pytest.approx(tau, rel=1e-12)
    assert r.interval_formula == "young" and r.warnings == []
    if best is not None:
        assert r.overhead_optimal == pytest.approx(best, abs=1e-6)
        assert r.hours_lost_per_day_optimal == pytest.approx(24 * best, abs=1e-4)
    assert r.overhead_optimal == pytest.approx(1 - _daly_eff(c, tau, m), rel=1e-12)
    assert r.overhead_chosen == pytest.approx(chosen, abs=1e-6)
    assert r.efficiency_chosen == pytest.approx(1 - chosen, abs=1e-6)
    assert r.interval_seconds == tau_chosen == r.chosen_interval_seconds
    # C and tau small against M: the first-order overhead is close to the model's
    assert overhead(c, tau_chosen, m) == pytest.approx(r.overhead_chosen, rel=0.05)
    # the optimum is (near) a minimum of the overhead
    assert r.overhead_optimal <= r.overhead_chosen


def test_daly_hand_computed_and_converging_to_young():
    # C = M/2: r = 1/4, sqrt(2 C M) = M: M (1 + 1/6 + 1/36) - M/2 = 6,944.44 for M = 10,000
    assert daly(5000, 10_000) == pytest.approx(10_000 * (1 + 1 / 6 + 1 / 36) - 5000,
                                               rel=1e-12)
    assert daly(5000, 10_000) == pytest.approx(6944.444444, abs=1e-6)
    # C = 1,500, M = 2.8 h: r = 1,500 / 20,160; sqrt(30,240,000) = 5,499.09 x 1.099191
    assert daly(1500, 10_080) == pytest.approx(4544.55, abs=0.01)
    # C >= 2M: tau = M (Daly)
    assert daly(20_000, 10_000) == daly(1e9, 10_000) == 10_000
    # C/M -> 0: Daly's tends to Young's sqrt(2 C M) (their difference is about C)
    for ratio in (1e-2, 1e-4, 1e-6, 1e-8):
        m = 86400.0
        c = ratio * m
        assert abs(daly(c, m) / young_daly(c, m) - 1) < 2 * math.sqrt(ratio)
    assert daly(1e-6, 86400) == pytest.approx(young_daly(1e-6, 86400), rel=1e-5)


@pytest.mark.parametrize("ratio", [0.05, 0.1, 0.2, 0.3, 0.5, 0.6])
def test_dalys_interval_is_near_the_models_optimum(ratio):
    # the exact optimum of the expected-time model, by a fine scan: Daly's interval
    # costs less than 0.2 points of efficiency against it (Young's, at 0.5: 1.5 points)
    m = 10_000.0
    c = ratio * m
    best = max(expected_efficiency(c, m * k / 2000, m) for k in range(1, 20_000))
    assert best - expected_efficiency(c, daly(c, m), m) < 0.002
    assert expected_efficiency(c, daly(c, m), m) >= expected_efficiency(
        c, young_daly(c, m), m) - 1e-12


def test_the_first_order_formula_is_used_only_while_c_is_small():
    # up to C/M = 0.1 Young's; above it Daly's, with a warning naming the ratio
    at = plan(10**12, FIRST_ORDER_RATIO * 10_000, 10_000)
    assert (at.interval_formula, at.warnings) == ("young", [])
    assert at.optimal_interval_seconds == young_daly(1000, 10_000)
    r = plan(10**12, 1500, 10_080)
    assert r.interval_formula == "daly"
    assert r.optimal_interval_seconds == daly(1500, 10_080)
    assert r.young_interval_seconds == young_daly(1500, 10_080)
    (w,) = r.warnings
    assert "C/M = 0.149 > 0.1" in w and "Daly's higher-order interval is used" in w
    # the model's cost, never the first-order one's (which is nonsense here)
    assert r.overhead_optimal == pytest.approx(1 - _daly_eff(1500, daly(1500, 10_080),
                                                              10_080), rel=1e-12)
    assert 0 < r.hours_lost_per_day_optimal < 24


@pytest.mark.parametrize("c, m", [(3600, 3600), (7200, 3600), (7000, 10_000)])
def test_a_save_time_no_interval_makes_progress_at_is_refused(c, m):
    # C >= M, or (C/M = 0.7) under 25% of the time training even at Daly's interval
    assert expected_efficiency(c, daly(c, m), m) < MIN_EFFICIENCY
    with pytest.raises(UsageError, match="no checkpoint interval makes useful progress"):
        plan(10**12, c, m)
    # C/M = 0.5 still trains 30% of the time: planned, with the warning
    r = plan(10**12, m / 2, m)
    assert r.interval_formula == "daly" and r.efficiency_optimal == pytest.approx(0.3017,
                                                                                  abs=1e-4)


@settings(deadline=None, max_examples=300)
@given(c=st.floats(1e-3, 1e7), m=st.floats(1.0, 1e10), tau=st.floats(1e-3, 1e10))
def test_time_lost_per_day_is_never_more_than_a_day(c, m, tau):
    lost = expected_overhead(c, tau, m)
    assert 0.0 <= lost <= 1.0
    assert 0.0 <= expected_efficiency(c, tau, m) <= tau / (tau + c) + 1e-12
    try:
        r = plan(10**12, c, m, interval_seconds=tau)
    except UsageError as e:
        assert "no checkpoint interval makes useful progress" in e.message
        return
    for h in (r.hours_lost_per_day_optimal, r.hours_lost_per_day_chosen):
        assert 0.0 <= h <= 24.0
    assert r.efficiency_optimal >= MIN_EFFICIENCY


def test_system_mtbf_from_the_nodes():
    # 5 years per node (vendor figure), 128 nodes: 157,680,000 / 128 = 1,231,875 s
    assert system_mtbf(5 * YEAR, 128) == 1_231_875.0
    r = plan(10**12, 60, node_mtbf_seconds=5 * YEAR, nodes=128)
    assert (r.mtbf_seconds, r.mtbf_source, r.node_mtbf_seconds) == (1_231_875.0, "node",
                                                                   5.0 * YEAR)
    assert r.optimal_interval_seconds == young_daly(60, 1_231_875.0)
    assert plan(10**12, 60, 3600).mtbf_source == "system"
    with pytest.raises(UsageError, match="give one of --mtbf"):
        plan(10**12, 60, 3600, node_mtbf_seconds=5 * YEAR)
    with pytest.raises(UsageError, match="--node-mtbf"):
        plan(10**12, 60)


def test_save_time_from_the_write_bandwidth():
    # 1 TB on 128 nodes at 2 GB/s each: 7.8125 GB per node, 3.90625 s
    r = plan(10**12, mtbf_seconds=10_080, nodes=128, node_write_bytes_per_second=2e9)
    assert (r.save_seconds, r.save_source, r.node_write_bytes_per_second) == (
        3.90625, "write-bandwidth", 2e9)
    assert r.optimal_interval_seconds == young_daly(3.90625, 10_080)
    with pytest.raises(UsageError, match="give one of --save-seconds"):
        plan(10**12, 60, 10_080, node_write_bytes_per_second=2e9)
    with pytest.raises(UsageError, match="--write-bandwidth must be more than 0"):
        plan(10**12, mtbf_seconds=10_080, node_write_bytes_per_second=0)


def test_without_an_interval_the_optimal_one_is_used():
    r = plan(10**12, 50, 10_000, nodes=100)
    assert r.chosen_interval_seconds is None and r.overhead_chosen is None
    assert r.interval_seconds == r.optimal_interval_seconds == 1000.0
    assert r.node_bandwidth_bytes_per_second == 10**12 / (100 * 1000) == 1e7


def test_per_node_bandwidth_and_capacity():
    # S = 1 TB on 128 nodes, tau = 1,000 s: 7.8125 GB per node per interval
    assert node_bandwidth(10**12, 128, 1000) == 7_812_500.0
    assert local_capacity(10**12, 128) == 15_625_000_000  # 2 x 7.8125 GB
    assert local_capacity(5, 3) == 4  # 10/3 rounded up: a byte short does not fit
    r = plan(10**12, 60, 10080, nodes=128, interval_seconds=1000)
    assert r.node_bandwidth_bytes_per_second == 7_812_500.0
    assert r.total_bandwidth_bytes_per_second == 1e9
    assert r.local_capacity_bytes == 15_625_000_000


def _m(name, write=None, read=None) -> Measurement:
    """A measurement of 1e9 bytes at the given rates (bytes/s)."""
    return Measurement(name, "/x", 10**9, 10**9 / write if write else 0.0,
                       10**9, 10**9 / read if read else 0.0)


def test_drains_fits_and_recovery():
    # S = 400 GB, P = 4, tau = 1,000 s (C = 50, M = 10,000)
    tiers = [TierInput("hot", measured=_m("hot", write=1e9, read=4e8)),
             TierInput("warm", bwlimit=2e8, measured=_m("warm", write=3e8)),
             TierInput("cold", bwlimit=1e8), TierInput("glacier")]
    r = plan(4 * 10**11, 50, 10_000, nodes=4, tiers=tiers)
    hot_warm, warm_cold, cold_glacier = r.hops
    # hot -> warm runs on every node: 100 GB each at min(warm bwlimit, warm write, hot
    # read) = 200 MB/s; both ends measured: the rate is known
    assert (hot_warm.bytes, hot_warm.streams, hot_warm.bytes_per_second) == (10**11, 4, 2e8)
    assert (hot_warm.rate_source, hot_warm.rate_kind) == ("warm bwlimit", "measured")
    assert (hot_warm.drain_seconds, hot_warm.fits) == (500.0, True)
    # warm -> cold moves all of S at most at cold's bwlimit, 100 MB/s: at least 4,000 s
    # > 1,000 s: known not to fit, though the rate is only a ceiling
    assert (warm_cold.bytes, warm_cold.streams, warm_cold.drain_seconds) == (4 * 10**11, 1,
                                                                             4000.0)
    assert (warm_cold.rate_kind, warm_cold.fits) == ("ceiling", False)
    assert (cold_glacier.bytes_per_second, cold_glacier.rate_source, cold_glacier.rate_kind,
            cold_glacier.drain_seconds, cold_glacier.fits) == (None, "unknown", "unknown",
                                                               None, None)
    assert r.all_fit is False
    # recovery: hot per node at its measured read, warm/cold at bwlimit, glacier unknown
    assert [(x.tier, x.bytes, x.bytes_per_second, x.seconds, x.rate_kind)
            for x in r.recovery] == [
        ("hot", 10**11, 4e8, 250.0, "measured"), ("warm", 4 * 10**11, 2e8, 2000.0, "ceiling"),
        ("cold", 4 * 10**11, 1e8, 4000.0, "ceiling"),
        ("glacier", 4 * 10**11, None, None, "unknown")]
    assert r.recovery[0].rate_source == "hot measured read"
    assert [x["rate_kind"] for x in r.to_dict()["recovery"]] == [
        "measured", "ceiling", "ceiling", "unknown"]


@pytest.mark.parametrize("hot, warm, kind", [
    (TierInput("hot"), TierInput("warm", bwlimit=1e9), "ceiling"),        # a bwlimit only
    (TierInput("hot", measured=_m("hot", read=1e9)), TierInput("warm"), "ceiling"),  # one end
    (TierInput("hot"), TierInput("warm", measured=_m("warm", write=1e9)), "ceiling"),
    (TierInput("hot"), TierInput("warm"), "unknown"),
])
def test_a_rate_not_known_never_fits(hot, warm, kind):
    # 1 GB in an interval of 1,000 s: at 1 GB/s it would take 1 s, but nothing says the
    # hop reaches 1 GB/s: "unknown", never "fits"
    (h,), _ = drains(10**9, [hot, warm], interval_seconds=1000)
    assert (h.rate_kind, h.fits) == (kind, None)
    r = plan(10**9, 50, 10_000, tiers=[hot, warm])
    assert r.all_fit is None and r.to_dict()["all_fit"] is None
    assert r.to_dict()["hops"][0]["fits"] is None
    # no hops at all: nothing was checked, so not "all fit" either
    assert plan(10**9, 50, 10_000).all_fit is None


def test_a_hop_that_ends_exactly_at_tau_fits_and_measured_rates_cap_bwlimit():
    # tau = 1,000 s; 100 GB at 100 MB/s = 1,000 s: fits (the next save starts then)
    both = [TierInput("hot", measured=_m("hot", read=9e9)),
            TierInput("warm", bwlimit=1e8, measured=_m("warm", 9e9, 9e9))]
    r = plan(10**11, 50, 10_000, tiers=both)
    assert (r.hops[0].drain_seconds, r.hops[0].fits, r.all_fit) == (1000.0, True, True)
    # a measured write slower than the bwlimit is the rate; a faster one changes nothing
    slow = [both[0], TierInput("warm", bwlimit=1e8, measured=_m("warm", 5e7, 9e9))]
    h = plan(10**11, 50, 10_000, tiers=slow).hops[0]
    assert (h.bytes_per_second, h.rate_source, h.fits) == (5e7, "warm measured write", False)
    assert plan(10**11, 50, 10_000, tiers=both).hops[0].bytes_per_second == 1e8
    # recovery prefers the measured read over the bwlimit, even when faster
    assert plan(10**11, 50, 10_000, tiers=both).recovery[1].bytes_per_second == 9e9


@pytest.mark.parametrize("kw, flag", [
    (dict(size_bytes=0), "checkpoint size"), (dict(save_seconds=0), "--save-seconds"),
    (dict(mtbf_seconds=-1), "--mtbf"), (dict(nodes=0), "--nodes"),
    (dict(interval_seconds=0), "--interval"), (dict(save_seconds=math.nan), "--save-seconds"),
])
def test_plan_refuses_inputs_out_of_range(kw, flag):
    args = dict(size_bytes=10**9, save_seconds=60, mtbf_seconds=3600)
    args.update({k: v for k, v in kw.items() if k in args})
    with pytest.raises(UsageError, match=flag):
        plan(args["size_bytes"], args["save_seconds"], args["mtbf_seconds"],
             **{k: v for k, v in kw.items() if k not in args})


# ------------------------------------------------------------------ the command line
def test_cli_the_issues_example(cli):
    doc = _doc(cli, *BASE, "--nodes", "128")
    assert doc["optimal_interval_seconds"] == pytest.approx(1099.818, abs=1e-3)
    assert doc["checkpoint_bytes"] == 10**12 and doc["nodes"] == 128
    assert doc["save_seconds"] == 60.0 and doc["mtbf_seconds"] == 10080.0
    assert doc["node_bandwidth_bytes_per_second"] == pytest.approx(10**12 / (128 * 1099.818),
                                                                   rel=1e-6)
    assert doc["local_capacity_bytes"] == 15_625_000_000
    assert doc["hops"] == [] and doc["recovery"] == [] and doc["measured"] == []
    assert (doc["interval_formula"], doc["mtbf_source"], doc["save_source"]) == (
        "young", "system", "save-seconds")
    assert doc["warnings"] == [] and doc["all_fit"] is None
    assert doc["overhead_optimal"] == pytest.approx(0.105241, abs=1e-6)
    code, out, err = cli("plan", *BASE, "--nodes", "128", "--interval", "30m")
    assert code == 0, err
    # Daly's model: 1 - (1,099.8/10,080) / (e^(1,159.8/10,080) - 1) = 10.52%; at 30m
    # 1 - (1,800/10,080) / (e^(1,860/10,080) - 1) = 11.88%
    assert "1,099.8 s" in out and "10.52%" in out and "2.53 h lost per day" in out
    assert "chosen interval 30m: 11.88% (2.85 h lost per day)" in out
    assert "(Young, first order" in out and "MTBF M = 10,080.0 s (2h48m) (--mtbf" in out
    assert err == ""
    assert "B >= S/(P tau)" in out and "2 S/P = 14.6 GiB" in out


@pytest.mark.parametrize("text, nbytes", [
    ("1TB", 10**12), ("1TiB", 2**40), ("1T", 2**40), ("800GB", 8 * 10**11),
    ("1.5GiB", 3 * 2**29), ("1e12", 10**12), ("512MB", 512 * 10**6), ("64M", 64 << 20)])
def test_sizes_decimal_and_binary(cli, text, nbytes):
    # KB/MB/GB/TB are powers of 1000, KiB..TiB and a bare K/M/G/T of 1024 (parse_size's
    # units; read with parse_rate, which needs no numpy)
    doc = _doc(cli, "--checkpoint-size", text, "--save-seconds", "60", "--mtbf", "1h")
    assert doc["checkpoint_bytes"] == nbytes and isinstance(doc["checkpoint_bytes"], int)


@pytest.mark.parametrize("mtbf, seconds", [("2.8h", 10080.0), ("1d", 86400.0),
                                           ("90m", 5400.0), ("3600", 3600.0),
                                           ("1y", 365 * 86400.0), ("0.5y", 182.5 * 86400),
                                           ("1Y12h", 365 * 86400.0 + 43200), ("2w", 1209600.0)])
def test_durations(cli, mtbf, seconds):
    doc = _doc(cli, "--checkpoint-size", "1GB", "--save-seconds", "10", "--mtbf", mtbf)
    assert doc["mtbf_seconds"] == seconds
    assert doc["optimal_interval_seconds"] == pytest.approx(math.sqrt(20 * seconds))


@pytest.mark.parametrize("args, says", [
    (("--save-seconds", "60", "--mtbf", "1h"), "--checkpoint-size SIZE or --checkpoint URL"),
    (("--checkpoint-size", "1TB", "--checkpoint", "/x", "--save-seconds", "60", "--mtbf",
      "1h"), "give one"),
    (("--checkpoint-size", "1TB", "--mtbf", "1h"), "--save-seconds"),
    (("--checkpoint-size", "1TB", "--save-seconds", "60"), "--mtbf"),
    ((*BASE[:4], "--mtbf", "soon"), "--mtbf: not a duration"),
    ((*BASE, "--interval", "0"), "--interval must be longer than 0"),
    (("--checkpoint-size", "1XB", "--save-seconds", "60", "--mtbf", "1h"),
     "--checkpoint-size: bad size"),
    (("--checkpoint-size", "nan", "--save-seconds", "60", "--mtbf", "1h"),
     "--checkpoint-size: bad size"),
    (("--checkpoint-size", "-1TB", "--save-seconds", "60", "--mtbf", "1h"),
     "--checkpoint-size: bad size"),
    (("--checkpoint-size", "0", "--save-seconds", "60", "--mtbf", "1h"),
     "--checkpoint-size must be more than 0"),
    (("--checkpoint-size", "1TB/s", "--save-seconds", "60", "--mtbf", "1h"),
     "--checkpoint-size: bad size"),
    ((*BASE[:2], "--save-seconds", "0", "--mtbf", "1h"), "--save-seconds must be more than 0"),
    ((*BASE, "--nodes", "0"), "--nodes"),
    ((*BASE, "--node-mtbf", "5y"), "--mtbf (the job's) and --node-mtbf (one node's) both"),
    ((*BASE, "--write-bandwidth", "2GB/s"), "--save-seconds and --write-bandwidth both"),
    (("--checkpoint-size", "1TB", "--mtbf", "1h"), "--write-bandwidth RATE"),
    (("--checkpoint-size", "1TB", "--save-seconds", "60"), "--node-mtbf DUR"),
    ((*BASE[:4], "--node-mtbf", "5yy"), "--node-mtbf: not a duration"),
    ((*BASE[:4], "--node-mtbf", "0y"), "--node-mtbf must be longer than 0"),
    (("--checkpoint-size", "1TB", "--write-bandwidth", "off", "--mtbf", "1h"),
     "--write-bandwidth: bad rate 'off'"),
    (("--checkpoint-size", "1TB", "--write-bandwidth", "fast", "--mtbf", "1h"),
     "--write-bandwidth: bad rate 'fast'"),
    (("--checkpoint-size", "1TB", "--save-seconds", "3600", "--mtbf", "1h"),
     "no checkpoint interval makes useful progress"),
    ((*BASE, "--measure", "warm"), "--measure needs a tier config"),
    ((*BASE, "--measure-size", "0"), "--measure-size"),
])
def test_usage_errors_are_one_line(cli, args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./ckptctl.toml
    monkeypatch.delenv("CKPTCTL_CONFIG", raising=False)
    err = _usage(cli, *args)
    assert says in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_cli_node_mtbf_and_write_bandwidth(cli):
    # 5 y per node on 512 nodes: M = 157,680,000 / 512 = 307,968.75 s; 1 TB at 2 GB/s
    # per node: C = 10^12 / (512 x 2 x 10^9) = 0.9765625 s
    args = ("--checkpoint-size", "1TB", "--write-bandwidth", "2GB/s", "--node-mtbf", "5y",
            "--nodes", "512")
    doc = _doc(cli, *args)
    assert (doc["mtbf_source"], doc["node_mtbf_seconds"], doc["mtbf_seconds"]) == (
        "node", 5.0 * YEAR, 307_968.75)
    assert (doc["save_source"], doc["node_write_bytes_per_second"], doc["save_seconds"]) == (
        "write-bandwidth", 2e9, 0.9765625)
    assert doc["optimal_interval_seconds"] == pytest.approx(math.sqrt(2 * 0.9765625
                                                                      * 307_968.75))
    assert doc["save_mtbf_ratio"] == pytest.approx(0.9765625 / 307_968.75)
    from ckptctl.catalog.vocabulary import must_be_int
    assert all(isinstance(v, int) for k, v in doc.items() if must_be_int(k) and v is not None)
    code, out, err = cli("plan", *args)
    assert code == 0 and err == "", err
    assert "MTBF M = node MTBF 157,680,000.0 s (1825d, 5 y) / 512 = 307,968.8 s" in out
    assert "--node-mtbf, independent node failures" in out
    assert "save C = S/(P x 1.9 GiB/s) = 0.977 s (--write-bandwidth" in out
    # --mtbf with --nodes: the job's MTBF as given, not divided
    assert _doc(cli, *BASE, "--nodes", "128")["mtbf_seconds"] == 10_080.0


def test_cli_warns_where_the_first_order_formula_does_not_hold(cli):
    args = ("--checkpoint-size", "1TB", "--save-seconds", "1500", "--mtbf", "2.8h")
    code, out, err = cli("plan", *args, "--json")
    assert code == 0, err
    doc = json.loads(out)  # the warning is on stderr: stdout stays one JSON document
    assert doc["interval_formula"] == "daly"
    assert doc["optimal_interval_seconds"] == pytest.approx(4544.55, abs=0.01)
    assert doc["young_interval_seconds"] == pytest.approx(5499.09, abs=0.01)
    assert len(doc["warnings"]) == 1 and "C/M = 0.149 > 0.1" in doc["warnings"][0]
    assert err.startswith("ckptctl: warning: save time C is 15% of the MTBF") and \
        len(err.strip().splitlines()) == 1, err
    code, out, err = cli("plan", *args)
    assert code == 0 and "Daly's higher-order estimate" in out and "warning" in err
    code, out, err = cli("plan", *args, "--quiet")
    assert (code, out, err) == (0, "", "")


def test_cli_an_interval_far_past_the_mtbf_loses_at_most_a_day_per_day(cli):
    # the first-order formula says 60/86,400 + 86,400/20,160 = 429% (103 h per day)
    doc = _doc(cli, *BASE, "--interval", "1d")
    assert overhead(60, 86400, 10080) > 4
    assert 0.99 < doc["overhead_chosen"] <= 1 and doc["hours_lost_per_day_chosen"] <= 24
    assert any("8.57 x the MTBF" in w for w in doc["warnings"])
    code, out, err = cli("plan", *BASE, "--interval", "1d")
    assert code == 0 and "99.84% (23.96 h lost per day)" in out
    assert "expected efficiency 0.16%" in err


def test_tiers_from_the_config(cli, tmp_path):
    cfg = _config(tmp_path / "ckptctl.toml",
                  {"name": "hot", "url": str(tmp_path / "hot")},
                  {"name": "warm", "url": str(tmp_path / "warm"), "bwlimit": "2GB/s"},
                  {"name": "cold", "url": str(tmp_path / "cold"), "bwlimit": "100MB/s"})
    doc = _doc(cli, "--config", str(cfg), "--checkpoint-size", "1TB", "--save-seconds", "50",
               "--mtbf", "10000", "--nodes", "100")
    assert doc["interval_seconds"] == 1000.0
    assert [(h["src"], h["dst"], h["bytes"], h["bytes_per_second"], h["drain_seconds"],
             h["fits"]) for h in doc["hops"]] == [
        ("hot", "warm", 10**10, 2e9, 5.0, None),      # a bwlimit is a ceiling: unknown
        ("warm", "cold", 10**12, 1e8, 10_000.0, False)]  # not even the ceiling fits
    assert [h["rate_kind"] for h in doc["hops"]] == ["ceiling", "ceiling"]
    assert doc["all_fit"] is False
    assert [(x["tier"], x["seconds"]) for x in doc["recovery"]] == [
        ("hot", None), ("warm", 500.0), ("cold", 10_000.0)]
    assert not any((tmp_path / t).exists() for t in ("hot", "warm", "cold"))  # untouched
    code, out, err = cli("--config", str(cfg), "plan", "--checkpoint-size", "1TB",
                         "--save-seconds", "50", "--mtbf", "10000", "--nodes", "100")
    assert code == 0, err
    assert "warm -> cold" in out and "NO" in out and "unknown" in out
    hot_warm = next(line for line in out.splitlines() if line.startswith("hot -> warm"))
    assert "yes" not in hot_warm and hot_warm.rstrip().endswith("unknown")
    assert "<= 1.9 GiB/s" in hot_warm and ">= 5.0 s" in hot_warm
    assert "<= a ceiling (a bwlimit" in out


# ------------------------------------------------------------------ --measure
def test_measure_a_local_tier(cli, tmp_path):
    hot = tmp_path / "hot"
    hot.mkdir()
    (hot / "keep.txt").write_text("mine")
    cfg = _config(tmp_path / "c.toml", {"name": "hot", "url": str(hot)},
                  {"name": "warm", "url": str(tmp_path / "new" / "warm")})
    doc = _doc(cli, "--config", str(cfg), *BASE, "--measure", "hot", "--measure", "warm:",
               "--measure-size", "6MiB")
    m = {x["tier"]: x for x in doc["measured"]}
    assert set(m) == {"hot", "warm"}
    for x in m.values():
        assert x["write_bytes"] == x["read_bytes"] == 6 << 20 and x["removed"] is True
        # rates in whole bytes per second (the JSON vocabulary's integers)
        assert isinstance(x["write_bytes_per_second"], int)
        assert x["write_bytes_per_second"] == round(x["write_bytes"] / x["write_seconds"])
    # the hop's rate is the slower of hot's measured read and warm's measured write
    hop = doc["hops"][0]
    assert hop["bytes_per_second"] == min(m["hot"]["read_bytes_per_second"],
                                          m["warm"]["write_bytes_per_second"])
    assert doc["recovery"][1]["bytes_per_second"] == m["warm"]["read_bytes_per_second"]
    # the probe is gone, the tier's own file stays, the folders made for it are removed
    assert os.listdir(hot) == ["keep.txt"] and not (tmp_path / "new").exists()


def test_measure_is_bounded_in_time(tmp_path):
    # a tiny time budget: one 4 MiB block written, one 1 MiB local block read, then stop
    m = measure_tier(Tier("hot", str(tmp_path)), size=64 << 20, seconds=1e-9)
    assert m.write_bytes == 4 << 20 and 0 < m.read_bytes < m.write_bytes
    assert os.listdir(tmp_path) == []


def test_a_tier_that_cannot_be_measured_is_exit_3(cli, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    cfg = _config(tmp_path / "c.toml", {"name": "hot", "url": str(tmp_path / "file" / "t")})
    code, out, err = cli("--config", str(cfg), "plan", *BASE, "--measure", "hot")
    assert (code, out) == (3, "") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and "cannot measure tier hot" in err, err
    assert sorted(os.listdir(tmp_path)) == ["c.toml", "file"]
    # an unknown tier is a usage error, found before anything is written
    err = _usage(cli, "--config", str(cfg), *BASE, "--measure", "cold")
    assert "unknown tier 'cold'" in err


def test_measure_an_s3_tier_leaves_nothing(cli, tmp_path, s3_bucket):
    o = s3_bucket.storage_options
    cfg = _config(tmp_path / "c.toml", {"name": "hot", "url": str(tmp_path / "hot")},
                  {"name": "cold", "url": s3_bucket.url("run1"), "bwlimit": "1GB/s",
                   "storage_options": {k: o[k] for k in ("endpoint_url", "key", "secret")}})
    doc = _doc(cli, "--config", str(cfg), *BASE, "--measure", "cold", "--measure-size",
               "7MiB")
    (m,) = doc["measured"]
    assert (m["tier"], m["url"], m["write_bytes"], m["read_bytes"], m["removed"]) == (
        "cold", s3_bucket.url("run1"), 7 << 20, 7 << 20, True)
    assert m["cache_dropped"] is False
    fs = s3_bucket.fs()
    assert fs.find(s3_bucket.path()) == []  # the probe object is gone
    assert doc["hops"][0]["bytes_per_second"] == min(1e9, m["write_bytes_per_second"])


# ------------------------------------------------------------------ --checkpoint URL
def test_checkpoint_url_is_sized_from_its_listing(cli, tmp_path, tiny_dcp):
    sizes = {p.name: p.stat().st_size for p in tiny_dcp.iterdir()}
    doc = _doc(cli, "--checkpoint", str(tiny_dcp), "--save-seconds", "60", "--mtbf", "1h")
    assert doc["checkpoint_bytes"] == sum(sizes.values())
    assert doc["checkpoint_url"] == str(tiny_dcp)
    # a folder of checkpoints: its newest committed one, also through TIER:NAME
    run = tmp_path / "run"
    run.mkdir()
    os.rename(tiny_dcp, run / "step-42")
    (run / "step-43").mkdir()  # incomplete: no .metadata
    (run / "step-43" / "__0_0.distcp").write_bytes(b"x" * 10)
    (run / "step-7").mkdir()
    for name, n in sizes.items():
        (run / "step-7" / name).write_bytes((run / "step-42" / name).read_bytes()[:n])
    cfg = _config(tmp_path / "c.toml", {"name": "warm", "url": str(run)})
    doc = _doc(cli, "--config", str(cfg), "--checkpoint", "warm:", "--save-seconds", "60",
               "--mtbf", "1h")
    assert doc["checkpoint_url"] == str(run / "step-42")
    assert doc["checkpoint_bytes"] == sum(sizes.values())
    assert checkpoint_size(f"{run}/step-42") == (str(run / "step-42"), sum(sizes.values()))


def test_checkpoint_url_errors(cli, tmp_path):
    code, out, err = cli("plan", "--checkpoint", str(tmp_path / "nope"), "--save-seconds",
                         "60", "--mtbf", "1h")
    assert (code, out) == (3, "") and len(err.strip().splitlines()) == 1, err
    (tmp_path / "empty").mkdir()
    code, out, err = cli("plan", "--checkpoint", str(tmp_path / "empty"), "--save-seconds",
                         "60", "--mtbf", "1h")
    assert (code, out) == (3, "") and "no checkpoint to size" in err, err


def test_plan_imports_neither_torch_nor_numpy():
    import subprocess
    import sys

    code = ("import sys\nfrom ckptctl.cli.main import main\ntry:\n"
            "    main(['plan', '--checkpoint-size', '1TB', '--save-seconds', '60', '--mtbf',"
            " '2.8h', '--json'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules), file=sys.stderr)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stderr.strip() == "[]", r.stderr
    assert json.loads(r.stdout)["optimal_interval_seconds"] == pytest.approx(1099.818, abs=1e-3)
