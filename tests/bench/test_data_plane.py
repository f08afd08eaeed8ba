"""`python -m bench.data_plane` runs end to end and prints what its docstring promises; its rates are not
judged here (a benchmark, not a timed test), only that every path moved the answer it should have."""

from support.bench import run_bench


def test_a_small_run_prints_every_rate_ratio_probe_and_memory_figure():
    out = run_bench("data_plane", "--batch", "1", "--seq", "64", "--reps", "1", "--rounds", "1")
    assert out["answer_mb"] == round(64 * 4 * 4096 * 2 / 1e6, 1)
    assert out["loopback_tcp_gbps"] > 0 and out["raw_c1_gbps"] > 0
    assert out["client_c1"]["tokens_per_s"] > 0 and out["client_c4"]["tokens_per_s"] > 0
    assert out["ratios"]["client_c4_over_c1"] == round(out["client_c4"]["gbps"] / out["client_c1"]["gbps"], 3)
    assert out["readyz_seconds"]["samples"] >= 1 and out["readyz_seconds"]["max"] > 0
    assert out["server_rss_mib"]["peak"] >= out["server_rss_mib"]["ready"] > 0
