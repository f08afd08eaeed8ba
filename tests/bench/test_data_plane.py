"""`python -m bench.data_plane` runs end to end and prints what its docstring promises; its rates are not
judged here (a benchmark, not a timed test), only that every path moved the answer it should have."""

from support.bench import run_bench

TOKENS, HIDDEN = 64, 4096


def test_a_small_run_prints_every_rate_ratio_probe_and_memory_figure_of_both_cases():
    # Two servers, one after the other: minutes on a loaded 2-core machine.
    out = run_bench("data_plane", "--batch", "1", "--seq", "64", "--reps", "1", "--rounds", "1", timeout=900)
    # hidden: the final state and 3 aux layers; layers_dflash: 5 layers and the pre-norm final state.
    for name, states, request in [
        ("hidden", 4, "format=hidden"),
        ("layers_dflash", 6, "format=layers&layers=1%2C2%2C3%2C4%2C5&final=prenorm"),
    ]:
        case = out[name]
        assert case["request"] == f"POST /v1/supervision?{request}"
        assert case["answer_mb"] == round(TOKENS * states * HIDDEN * 2 / 1e6, 1)
        assert case["loopback_tcp_gbps"] > 0 and case["raw_c1_gbps"] > 0
        assert case["client_c1"]["tokens_per_s"] > 0 and case["client_c4"]["tokens_per_s"] > 0
        assert case["readyz_seconds"]["samples"] >= 1 and case["readyz_seconds"]["max"] > 0
        assert case["server_rss_mib"]["peak"] >= case["server_rss_mib"]["ready"] > 0
    # Each case's server captures what its request reads, the whole capture set in its order.
    assert (out["hidden"]["capture_layer_ids"], out["layers_dflash"]["capture_layer_ids"]) == (
        [1, 3, 4],
        [1, 2, 3, 4, 5],
    )
    assert out["layers_over_hidden"]["client_c1_gbps"] > 0
