"""`python -m bench.train` runs end to end and prints what its docstring promises; its rates are not judged
here (a benchmark, not a timed test), only that both paths ran and trained the same draft alike."""

from support.bench import run_bench


def test_a_quick_run_prints_both_rates_and_how_the_cores_were_shared():
    out = run_bench("train", "--quick", "--rounds", "1", "--steps", "1")
    assert out["inprocess_tokens_per_s"] > 0 and out["served_tokens_per_s"] > 0
    assert abs(out["ratio"] - out["served_tokens_per_s"] / out["inprocess_tokens_per_s"]) < 0.01
    assert len(out["inprocess_rounds"]) == len(out["served_rounds"]) == 1
    assert 0 < out["inprocess_target_share"] < 1
    assert set(out["torch_threads"]) == {"inprocess", "served_trainer", "server"}
    assert out["server_env"]["OMP_NUM_THREADS"] == str(out["torch_threads"]["server"])
    # Same corpus, draft and target both ways: the per-step losses agree up to float summation order.
    assert out["loss_max_abs_diff"] < 1e-3
