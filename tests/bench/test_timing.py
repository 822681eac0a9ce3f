"""``bench.timing.busy_and_gaps``: the GPU's busy time as the union of kernel intervals, its idle gaps by size and by
where in the run they fall, on hand-made kernel events (times in us, as the profiler gives them)."""

from types import SimpleNamespace

import pytest

from llmplug.bench.timing import busy_and_gaps


def kernel(start_us: float, duration_us: float, name: str = "k") -> SimpleNamespace:
    return SimpleNamespace(time_range=SimpleNamespace(start=start_us), device_time=duration_us, name=name)


def test_overlapping_kernels_count_once_and_gaps_land_in_their_bucket():
    events = [kernel(0, 100, "a"), kernel(50, 100, "b"),  # overlap: busy 0-150
              kernel(350, 10, "c"),                        # 200 us gap before it
              kernel(60_360, 40, "d")]                     # 60 ms gap, starting in the first 50 ms
    busy, gaps = busy_and_gaps(events, bucket_ms=50.0)
    assert busy == pytest.approx((150 + 10 + 40) * 1e-6)
    assert gaps["all"] == (2, pytest.approx((200 + 60_000) * 1e-6))
    assert gaps[">= 0.1 ms"] == (2, pytest.approx((200 + 60_000) * 1e-6))
    assert gaps[">= 1 ms"] == (1, pytest.approx(60_000 * 1e-6))
    assert gaps["largest"][0] == (0.36, 60.0, "c", "d")
    assert gaps["idle_ms_by_bucket"] == [60.2, 0.0]  # both gaps start in 0-50 ms; the run ends in 50-100 ms


def test_no_kernels():
    busy, gaps = busy_and_gaps([])
    assert busy == 0.0
    assert gaps["all"] == (0, 0.0) and gaps["largest"] == [] and gaps["idle_ms_by_bucket"] == []
