"""`python -m bench.stalled_readers` runs end to end and prints what its docstring promises; the RSS figures
are judged by tests/eagle3_target/server/test_streaming.py, only that every reader was let go is here."""

from support.bench import run_bench


def test_a_small_run_prints_the_memory_figures_and_lets_every_reader_go():
    out = run_bench("stalled_readers", "--readers", "3", "--tokens", "64", "--send-timeout", "1")
    assert out["send_timeouts"] == 3 and out["answer_mib"] == 4.0
    assert set(out["rss_mib"]) == {"before", "held_peak", "after_release"}
    assert out["rss_mib"]["held_peak"] >= out["rss_mib"]["before"] > 0
    assert 1 <= out["released_after_s"] < 60
