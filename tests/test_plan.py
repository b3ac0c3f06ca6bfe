"""``ckptctl plan``: Young/Daly arithmetic checked against hand-computed cases (issue 11),
drains and fits, the per-node bandwidth, local capacity, recovery, parsing, and
``--measure`` at a local tier and a real (rclone) S3 tier, whose probe must be gone."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from ckptctl.config import Tier
from ckptctl.errors import UsageError
from ckptctl.ops.plan import (Measurement, TierInput, checkpoint_size, local_capacity,
                              measure_tier, node_bandwidth, overhead, plan, young_daly)

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


@pytest.mark.parametrize("c, m, tau, best, chosen, tau_chosen", [
    (50, 10_000, 1000.0, 0.1, 0.125, 2000),        # 50/2000 + 2000/20000
    (2, 10_000, 200.0, 0.02, 0.025, 400),          # 2/400 + 400/20000 = 0.005 + 0.02
    (60, 5 * 3600, math.sqrt(2_160_000), None, 1 / 12, 1800),  # 1/30 + 1/20 = 1/12
])
def test_hand_computed_intervals_and_overheads(c, m, tau, best, chosen, tau_chosen):
    r = plan(10**9, c, m, interval_seconds=tau_chosen)
    assert r.optimal_interval_seconds == pytest.approx(tau, rel=1e-12)
    if best is not None:
        assert r.overhead_optimal == pytest.approx(best, rel=1e-12)
        assert r.hours_lost_per_day_optimal == pytest.approx(24 * best, rel=1e-12)
    assert r.overhead_chosen == pytest.approx(chosen, abs=5e-5)
    assert r.interval_seconds == tau_chosen == r.chosen_interval_seconds
    # the optimum is a minimum of the overhead
    assert r.overhead_optimal <= r.overhead_chosen
    assert r.overhead_optimal < overhead(c, tau * 1.01, m)
    assert r.overhead_optimal < overhead(c, tau * 0.99, m)


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
             TierInput("warm", bwlimit=2e8), TierInput("cold", bwlimit=1e8),
             TierInput("glacier")]
    r = plan(4 * 10**11, 50, 10_000, nodes=4, tiers=tiers)
    hot_warm, warm_cold, cold_glacier = r.hops
    # hot -> warm runs on every node: 100 GB each at min(warm bwlimit, hot read) = 200 MB/s
    assert (hot_warm.bytes, hot_warm.streams, hot_warm.bytes_per_second) == (10**11, 4, 2e8)
    assert hot_warm.rate_source == "warm bwlimit"
    assert (hot_warm.drain_seconds, hot_warm.fits) == (500.0, True)
    # warm -> cold moves all of S at 100 MB/s: 4,000 s > 1,000 s
    assert (warm_cold.bytes, warm_cold.streams, warm_cold.drain_seconds) == (4 * 10**11, 1,
                                                                             4000.0)
    assert warm_cold.fits is False
    assert (cold_glacier.bytes_per_second, cold_glacier.rate_source,
            cold_glacier.drain_seconds, cold_glacier.fits) == (None, "unknown", None, None)
    assert r.all_fit is False
    # recovery: hot per node at its measured read, warm/cold at bwlimit, glacier unknown
    assert [(x.tier, x.bytes, x.bytes_per_second, x.seconds) for x in r.recovery] == [
        ("hot", 10**11, 4e8, 250.0), ("warm", 4 * 10**11, 2e8, 2000.0),
        ("cold", 4 * 10**11, 1e8, 4000.0), ("glacier", 4 * 10**11, None, None)]
    assert r.recovery[0].rate_source == "hot measured read"


def test_a_hop_that_ends_exactly_at_tau_fits_and_measured_rates_cap_bwlimit():
    # tau = 1,000 s; 100 GB at 100 MB/s = 1,000 s: fits (the next save starts then)
    tiers = [TierInput("hot"), TierInput("warm", bwlimit=1e8)]
    r = plan(10**11, 50, 10_000, tiers=tiers)
    assert (r.hops[0].drain_seconds, r.hops[0].fits, r.all_fit) == (1000.0, True, True)
    # a measured write slower than the bwlimit is the rate; a faster one changes nothing
    slow = [TierInput("hot"), TierInput("warm", bwlimit=1e8, measured=_m("warm", 5e7, 9e9))]
    h = plan(10**11, 50, 10_000, tiers=slow).hops[0]
    assert (h.bytes_per_second, h.rate_source, h.fits) == (5e7, "warm measured write", False)
    fast = [TierInput("hot"), TierInput("warm", bwlimit=1e8, measured=_m("warm", 9e9, 9e9))]
    assert plan(10**11, 50, 10_000, tiers=fast).hops[0].bytes_per_second == 1e8
    # recovery prefers the measured read over the bwlimit, even when faster
    assert plan(10**11, 50, 10_000, tiers=fast).recovery[1].bytes_per_second == 9e9


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
    code, out, err = cli("plan", *BASE, "--nodes", "128", "--interval", "30m")
    assert code == 0, err
    assert "1,099.8 s" in out and "10.91%" in out and "2.62 h lost per day" in out
    assert "chosen interval 30m: 12.26% (2.94 h lost per day)" in out
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
                                           ("90m", 5400.0), ("3600", 3600.0)])
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
    ((*BASE, "--measure", "warm"), "--measure needs a tier config"),
    ((*BASE, "--measure-size", "0"), "--measure-size"),
])
def test_usage_errors_are_one_line(cli, args, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./ckptctl.toml
    monkeypatch.delenv("CKPTCTL_CONFIG", raising=False)
    err = _usage(cli, *args)
    assert says in err, err


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
        ("hot", "warm", 10**10, 2e9, 5.0, True),
        ("warm", "cold", 10**12, 1e8, 10_000.0, False)]
    assert doc["all_fit"] is False
    assert [(x["tier"], x["seconds"]) for x in doc["recovery"]] == [
        ("hot", None), ("warm", 500.0), ("cold", 10_000.0)]
    assert not any((tmp_path / t).exists() for t in ("hot", "warm", "cold"))  # untouched
    code, out, err = cli("--config", str(cfg), "plan", "--checkpoint-size", "1TB",
                         "--save-seconds", "50", "--mtbf", "10000", "--nodes", "100")
    assert code == 0, err
    assert "warm -> cold" in out and "NO" in out and "unknown" in out


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
        assert x["write_bytes_per_second"] == x["write_bytes"] / x["write_seconds"]
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
