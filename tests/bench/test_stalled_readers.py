"""`python -m bench.stalled_readers` runs end to end and prints what its docstring promises; the RSS figures
are judged by tests/eagle3_target/server/test_streaming.py, only that every reader was let go, after the send
timeout and not long after it, is here."""

from support.bench import run_bench

SEND_TIMEOUT = 2


def test_a_small_run_prints_the_memory_figures_and_lets_every_reader_go_after_the_send_timeout():
    out = run_bench(
        "stalled_readers", "--readers", "3", "--tokens", "64", "--send-timeout", str(SEND_TIMEOUT)
    )
    assert out["send_timeouts"] == 3 and out["answer_mib"] == 4.0
    assert set(out["rss_mib"]) == {"before", "held_peak", "after_release"}
    # Held for the whole send timeout (no reader is let go early), and let go soon after it.
    assert SEND_TIMEOUT <= out["released_after_s"] < 4 * SEND_TIMEOUT
