"""The simulators: published figures they must reproduce, calibration from a run folder, the CLI's output and errors."""
from __future__ import annotations

import json
import sys

import pytest

from dtk.errors import DtkError
from dtk.sim import congestion as cg
from dtk.sim import productivity as prod
from dtk.sim.calibrate import calibrate_inplace, inplace_recovery_s


def cluster_with_mtbf(*, gpus: int, mtbf_s: float, days: float = 60) -> prod.Cluster:
    """A cluster whose whole-job mean time between failures is `mtbf_s` (8 GPUs per node)."""
    per_1000_node_days = 1000 * prod.DAY_S / (mtbf_s * gpus / 8)
    return prod.Cluster(gpus=gpus, failures_per_1000_node_days=per_1000_node_days, days=days)


# --- published figures ---------------------------------------------------------------------------------------------

def test_mttf_matches_kokolis_et_al():
    # 6.50 failures per 1,000 node-days, 8 GPUs per node: 1.8 h at 16,384 GPUs, 0.23 h at 131,072 (rounded)
    assert prod.Cluster(gpus=16_384).mttf_s / 3600 == pytest.approx(1.8, abs=0.01)
    assert prod.Cluster(gpus=131_072).mttf_s / 3600 == pytest.approx(0.23, abs=0.006)


def test_full_stall_of_10_min_every_18_min_gives_44_percent():
    # arXiv 2602.00277, synchronous case: 98,000 GPUs, job MTBF 18 min, each failure stalls all 10 min
    c = cluster_with_mtbf(gpus=98_000, mtbf_s=18 * 60)
    for seed in (0, 1, 2):
        out = prod.simulate(prod.InPlace(recovery_s=600), c, seed=seed)
        assert out.productive_time_ratio == pytest.approx(0.44, abs=0.012)
        assert out.failures == pytest.approx(c.period_s / c.mttf_s, rel=0.05)


def test_twelve_replicas_give_80_percent():
    # the same paper's fault-tolerant case: 3 min full stall, then 11/12 throughput for 7 min
    c = cluster_with_mtbf(gpus=98_000, mtbf_s=18 * 60)
    for seed in (0, 1, 2):
        out = prod.simulate(prod.Replica(replicas=12, stall_s=180, rejoin_s=420), c, seed=seed)
        assert out.productive_time_ratio == pytest.approx(0.80, abs=0.015)


@pytest.mark.parametrize("every_s", [None, 600.0, 1800.0])
def test_young_daly_first_order_agrees_where_its_assumptions_hold(every_s):
    # tau, restart and save all small against the MTTF (1.8 h): the first-order formula holds to within 1%
    c = prod.Cluster(gpus=16_384, days=365)
    method = prod.Checkpoint(every_s=every_s, save_s=10, restart_s=60)
    out = prod.simulate(method, c, seed=3)
    assert out.productive_time_ratio == pytest.approx(out.first_order, abs=0.01)
    assert 0.85 < out.productive_time_ratio < 0.97


def test_young_daly_interval_is_near_the_simulated_optimum():
    c = prod.Cluster(gpus=16_384, days=365)
    auto = prod.Checkpoint(save_s=10, restart_s=60)
    best = prod.simulate(auto, c, seed=5).productive_time_ratio
    for factor in (0.25, 4.0):  # far from the Daly interval is clearly worse on the same failures
        other = prod.Checkpoint(every_s=auto.interval_at(c) * factor, save_s=10, restart_s=60)
        assert prod.simulate(other, c, seed=5).productive_time_ratio < best - 0.005


# --- behaviour -----------------------------------------------------------------------------------------------------

def test_same_seed_same_result_and_other_seeds_differ():
    c = prod.Cluster(gpus=131_072)
    a = prod.simulate(prod.Checkpoint(), c, seed=7)
    assert prod.simulate(prod.Checkpoint(), c, seed=7) == a
    assert prod.simulate(prod.Checkpoint(), c, seed=8).failures != a.failures


def test_five_million_gpus_and_faster_recovery_is_better():
    c = prod.Cluster(gpus=5_000_000)
    ratios = [prod.simulate(prod.InPlace(recovery_s=s), c, seed=0).productive_time_ratio for s in (0.5, 2.0, 6.78)]
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[0] > 0.97 and ratios[2] < 0.75  # a failure every ~21 s: 6.8 s per failure costs about a third
    assert prod.simulate(prod.Checkpoint(), c, seed=0).productive_time_ratio < 0.01  # restarts never catch up


def test_recovery_needed_for_a_target():
    c = prod.Cluster(gpus=5_000_000)
    needed = prod.recovery_needed(prod.InPlace(), c, target=0.9)
    assert needed == pytest.approx(0.1 * c.mttf_s, rel=0.03)  # each failure stalls the job: 1 - D/M
    assert prod.simulate(prod.InPlace(recovery_s=needed), c).productive_time_ratio >= 0.9
    # a 30 s blocking save every few minutes costs more than 10% by itself at 131,072 GPUs
    assert prod.recovery_needed(prod.Checkpoint(save_s=30), prod.Cluster(gpus=131_072), target=0.9) is None


# --- calibration from a run folder ---------------------------------------------------------------------------------

def write_summary(folder, failures) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps({"steps": 30, "failures": failures}))


def test_calibrate_takes_the_median_of_in_place_downtimes(tmp_path):
    write_summary(tmp_path / "run", [
        {"fault": "kill", "rank": 1, "downtime_s": 6.0, "breakdown_s": {"detect": 0.1, "regroup_and_repair": 5.5}},
        {"fault": "kill", "rank": 0, "downtime_s": 8.0, "breakdown_s": {"detect": 0.1, "promote": 0.2}},
        {"fault": "kill", "rank": 1, "downtime_s": 30.0, "recovery": "checkpoint restart"},
        {"fault": "hang", "rank": 1, "downtime_s": None},
        {"fault": "kill", "rank": 1, "downtime_s": 7.5, "recovery": "shadow"},
    ])
    assert inplace_recovery_s(tmp_path / "run") == (7.5, 3)


def test_protection_cost_is_charged_all_the_time_and_redo_per_failure():
    c = cluster_with_mtbf(gpus=16_384, mtbf_s=3600)
    free = prod.simulate(prod.InPlace(recovery_s=5), c, seed=0)
    costly = prod.simulate(prod.InPlace(recovery_s=5, protection_cost=0.1), c, seed=0)
    assert costly.productive_time_ratio == pytest.approx(free.productive_time_ratio * 0.9)
    assert costly.first_order == pytest.approx(free.first_order * 0.9)
    redo = prod.simulate(prod.InPlace(recovery_s=5, redo_s=60), c, seed=0)
    assert redo.productive_time_ratio == pytest.approx(prod.simulate(prod.InPlace(recovery_s=65), c, seed=0)
                                                       .productive_time_ratio)


def test_crossover_job_size_where_in_place_overtakes_checkpointing():
    ckpt, flags = prod.Checkpoint(), dict(gpus_per_node=8, failures_per_1000_node_days=6.5, days=30)
    at = prod.crossover_gpus(prod.InPlace(recovery_s=5, protection_cost=0.05), ckpt, up_to=5_000_000, **flags)
    assert at is not None and at % 8 == 0
    for gpus, inplace_wins in ((at - 8, False), (at, True)):
        c = prod.Cluster(gpus=gpus, **{k: v for k, v in flags.items() if k != "gpus_per_node"})
        gain = prod.first_order(prod.InPlace(recovery_s=5, protection_cost=0.05), c) - prod.first_order(ckpt, c)
        assert (gain > 0) == inplace_wins
    assert prod.crossover_gpus(prod.InPlace(recovery_s=5), ckpt, up_to=5_000_000, **flags) == 0  # free: always
    assert prod.crossover_gpus(prod.InPlace(recovery_s=5, protection_cost=0.99), ckpt, up_to=1024, **flags) is None


def test_calibrate_takes_the_protection_cost_from_a_baseline_or_the_parity_stall(tmp_path):
    write_summary(tmp_path / "run", [{"fault": "kill", "downtime_s": 2.0}])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    summary.update(throughput=900.0, step_time_p50=0.5, parity={"exchange": {"totals": {"stall_s": 1.5, "seconds": 4.5}}})
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "summary.json").write_text(json.dumps({"throughput": 1000.0, "failures": []}))
    with_base = calibrate_inplace(tmp_path / "run", baseline=tmp_path / "base")
    assert with_base.recovery_s == 2.0 and with_base.protection_cost == pytest.approx(0.1)
    alone = calibrate_inplace(tmp_path / "run")
    assert alone.protection_cost == pytest.approx(4.5 / (30 * 0.5)) and "10.0%, the lower bound" in alone.cost_source


def test_calibrate_errors_are_one_line(tmp_path):
    write_summary(tmp_path / "ckpt", [{"fault": "kill", "downtime_s": 9.0, "recovery": "checkpoint restart"}])
    with pytest.raises(DtkError, match="--calibrate: .* has no in-place recovery"):
        inplace_recovery_s(tmp_path / "ckpt")
    with pytest.raises(DtkError, match="no summary.json"):
        inplace_recovery_s(tmp_path / "missing")


# --- congestion ----------------------------------------------------------------------------------------------------

def test_ring_time_is_alpha_beta_on_uniform_links():
    net = cg.star(hosts=4, host_bps=1e9)
    t = cg.plan_time(net, cg.ring([0, 1, 2, 3], 4e8), alpha_s=1e-3)
    assert t == pytest.approx(6 * 1e-3 + 1.5 * 4e8 / 1e9)


def test_predicts_the_measured_three_host_test_bed():
    # FACTS.md: 3 ranks, 64 MiB all-reduce: 0.13-0.17 s unshaped, 3.8 s with one host at 200 mbit, 3.75 s one pair
    rows = cg.testbed_predictions(hosts=3, sizes=(64 * 2**20,))
    native = {r["congest"]: r["time_s"] for r in rows if r["plan"] == "native ring"}
    assert 0.13 <= native["none"] <= 0.17
    assert native["host=0,rate=200mbit"] == pytest.approx(3.8, rel=0.15)
    assert native["pair=0-1,rate=200mbit"] == pytest.approx(3.75, rel=0.15)


def test_four_host_test_bed_plans():
    rows = cg.testbed_predictions(hosts=4, sizes=(64 * 2**20,))
    chosen = {r["congest"]: r for r in rows if r["chosen"]}
    assert chosen["none"]["plan"] == "native ring" and chosen["none"]["gain_vs_native"] == 1.0
    assert chosen["pair=0-1,rate=200mbit"]["plan"] == "reordered ring"
    assert chosen["pair=0-1,rate=200mbit"]["gain_vs_native"] > 10  # the shaped path is avoidable
    host = chosen["host=0,rate=200mbit"]
    assert host["plan"] == "leaf tree (pipelined)"
    assert host["gain_vs_native"] == pytest.approx(2 * 3 / 4, rel=0.02)  # the bound 2(p-1)/p of a leaf plan


def test_reordered_ring_routes_around_a_congested_spine_link():
    net = cg.fat_tree(hosts=16, host_bps=50e9, hosts_per_leaf=4, spines=2)
    used = net.routes[3, 4][0]  # the native ring's hop from leaf 0 to leaf 1
    slow = cg.congest_links(net, {used[1]: net.capacity[used[1]] * 0.05})
    times = cg.compare_plans(slow, 2**28, alpha_s=1e-5)
    assert times["native ring"] / times["reordered ring"] > 5
    assert cg.compare_plans(net, 2**28, alpha_s=1e-5)["reordered ring"] == pytest.approx(
        cg.compare_plans(net, 2**28, alpha_s=1e-5)["native ring"])


# --- the command line ----------------------------------------------------------------------------------------------

def run_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    from dtk import cli

    monkeypatch.setattr(sys, "argv", ["dtk", *args])
    with pytest.raises(SystemExit) as info:
        cli.main()
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def test_productivity_cli_writes_json_and_png(monkeypatch, capsys, tmp_path):
    write_summary(tmp_path / "run", [{"fault": "kill", "downtime_s": 0.5}])
    code, out, err = run_cli(monkeypatch, capsys, "simulate", "productivity", "--gpus", "16384,131072", "--target", "0.9",
                             "--calibrate", str(tmp_path / "run"), "--json", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "recovery time needed for 90.0%" in out and "median downtime_s of 1" in out
    assert "inplace protection cost 0.0%" in out and "inplace keeps more of the time" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["inputs"]["gpus"] == [16384, 131072] and "command" in data["inputs"]
    big = data["results"][1]["methods"]
    assert set(big) == {"checkpoint", "inplace", "replica"}
    assert big["inplace"]["recovery_s"] == 0.5 and big["inplace"]["productive_time_ratio"] > 0.99
    assert big["inplace"]["failures"] == big["checkpoint"]["failures"] > 1000  # the same failures for each method
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["--method", "pray"], "--method: got 'pray'; accepted: checkpoint, inplace, replica"),
    (["--gpus", "1k"], "--gpus: got '1k'"),
    (["--checkpoint-every-s", "-5"], "--checkpoint-every-s: got '-5'"),
    (["--days", "0"], "--days: got 0"),
    (["--recovery-s", "1", "--calibrate", "x"], "--recovery-s and --calibrate"),
    (["--calibrate", "no/such/run"], "--calibrate: got 'no/such/run', which has no summary.json"),
    (["--protection-cost", "1.5"], "--protection-cost: got 1.5; accepted: a fraction"),
    (["--calibrate-baseline", "x"], "--calibrate-baseline: got 'x' without --calibrate"),
    (["--redo-s", "-1"], "--redo-s: got -1"),
])
def test_productivity_bad_flags_one_line_exit_2_nothing_written(monkeypatch, capsys, tmp_path, args, message):
    code, out, err = run_cli(monkeypatch, capsys, "simulate", "productivity", *args, "--json", str(tmp_path / "p.json"))
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err
    assert not (tmp_path / "p.json").exists()


def test_congestion_cli(monkeypatch, capsys, tmp_path):
    code, out, err = run_cli(monkeypatch, capsys, "simulate", "congestion", "--topology", "rails", "--hosts", "8",
                             "--trials", "20", "--json", str(tmp_path / "c.json"))
    assert code == 0, err
    data = json.loads((tmp_path / "c.json").read_text())
    assert len(data["draws"]) == 20 and all(d["gain"] >= 1.0 for d in data["draws"])
    assert {r["congest"] for r in data["testbed_predictions"]} == {"none", "pair=0-1,rate=200mbit", "host=0,rate=200mbit"}
    assert (tmp_path / "c.png").exists()
    code, _, err = run_cli(monkeypatch, capsys, "simulate", "congestion", "--topology", "torus")
    assert code == 2 and "--topology: got 'torus'; accepted: star, fat-tree, rails" in err


def test_edge_cases_small_job_and_free_saves(monkeypatch, capsys, tmp_path):
    tiny = prod.Cluster(gpus=8, days=1)  # expected 0.0065 failures: none with this seed
    assert prod.simulate(prod.Checkpoint(), tiny, seed=0).failures == 0
    assert prod.recovery_needed(prod.InPlace(), tiny, target=0.9) == float("inf")
    free = prod.simulate(prod.Checkpoint(save_s=0, restart_s=60), prod.Cluster(gpus=16_384), seed=0)
    assert free.productive_time_ratio == pytest.approx(1 - 60 / prod.Cluster(gpus=16_384).mttf_s, abs=0.01)
    code, out, err = run_cli(monkeypatch, capsys, "simulate", "productivity", "--gpus", "8", "--days", "1",
                             "--target", "0.9", "--json", str(tmp_path / "p.json"))
    assert code == 0, err
    assert "any (no failure)" in out
    assert json.loads((tmp_path / "p.json").read_text())["results"][0]["methods"]["inplace"]["recovery_needed_s"] is None
    code, _, err = run_cli(monkeypatch, capsys, "simulate", "productivity", "--gpus", "5000000", "--days", "10000")
    assert code == 2 and "about 40,625,000 failures" in err


def test_inplace_fallback_to_checkpoint_restart():
    c = prod.Cluster(gpus=131_072)
    clean = prod.simulate(prod.InPlace(recovery_s=5), c, seed=0)
    assert clean.details["fallback_failures"] == 0
    ckpt = prod.Checkpoint(save_s=10, restart_s=120)
    some = prod.simulate(prod.InPlace(recovery_s=5, fallback=0.1, checkpoint=ckpt), c, seed=0)
    assert some.details["fallback_failures"] == pytest.approx(0.1 * some.failures, rel=0.2)
    assert some.productive_time_ratio < clean.productive_time_ratio
    assert some.productive_time_ratio == pytest.approx(some.first_order, abs=0.01)
    # every failure falling back is exactly the checkpoint method on the same failures
    every = prod.simulate(prod.InPlace(recovery_s=5, fallback=1.0, checkpoint=ckpt), c, seed=0)
    assert every.productive_time_ratio == pytest.approx(prod.simulate(ckpt, c, seed=0).productive_time_ratio)
