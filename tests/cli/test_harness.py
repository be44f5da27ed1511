"""The one timing harness: spreads, ratios per round, interleaving, target lines."""

from __future__ import annotations

import pytest
import torch

from tensorhooks.cli._harness import Spread, Timings, check_target, cuda_event_seconds, interleaved


class TestHarness:
    def test_spread_and_ratios_per_round(self) -> None:
        """Ratios are taken round by round; the spread is min, median, max."""
        timings = Timings({"a": [1.0, 2.0, 4.0], "b": [2.0, 2.0, 2.0]})
        assert timings.ratio("a", "b") == Spread(0.5, 1.0, 2.0)
        assert timings.spread("a").format() == "2.00x (1.00-4.00)"

    def test_interleaved_times_every_variant_every_round(self) -> None:
        """Each variant gets one sample per round, and progress is told each round."""
        calls = {"a": 0, "b": 0}
        done: list[int] = []

        def count(name: str) -> None:
            calls[name] += 1

        timings = interleaved(
            {"a": lambda: count("a"), "b": lambda: count("b")},
            rounds=3,
            inner=4,
            progress=done.append,
        )
        assert [len(timings.samples[name]) for name in ("a", "b")] == [3, 3]
        assert done == [1, 2, 3]
        assert calls["a"] == calls["b"] >= 12

    def test_without_per_round_warm_up_exactly_the_asked_calls(self) -> None:
        """warm_each_round=False calls each variant warmup + rounds x inner times, no more."""
        calls = {"a": 0, "b": 0}

        def count(name: str) -> None:
            calls[name] += 1

        timings = interleaved(
            {"a": lambda: count("a"), "b": lambda: count("b")},
            rounds=5,
            inner=2,
            warmup=1,
            warm_each_round=False,
        )
        assert calls == {"a": 1 + 5 * 2, "b": 1 + 5 * 2}
        assert all(seconds > 0 for seconds in timings.samples["a"])

    def test_warmup_and_before_each(self) -> None:
        """Warm-up calls run first, in order; before_each runs before every variant's timing."""
        log: list[str] = []
        interleaved(
            {"a": lambda: log.append("a"), "b": lambda: log.append("b")},
            rounds=2,
            inner=1,
            warmup=2,
            before_each=lambda: log.append("|"),
        )
        assert log[:4] == ["a", "b", "a", "b"]
        assert log.count("|") == 4
        # Every timing (warm-up calls of Timer included) comes after its own before_each.
        timed = "".join(log[4:]).split("|")[1:]
        assert [set(chunk) for chunk in timed] == [{"a"}, {"b"}, {"b"}, {"a"}]

    @pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a CUDA device")
    def test_cuda_event_seconds_times_device_work(self) -> None:
        """A step that keeps the device busy longer reads as longer."""
        x = torch.randn(1024, 1024, device="cuda")
        short = cuda_event_seconds(lambda: x @ x, inner=3)
        long = cuda_event_seconds(lambda: [x @ x for _ in range(20)], inner=3)
        assert 0 < short < long

    def test_missed_target_says_so(self, capsys: pytest.CaptureFixture[str]) -> None:
        """A missed target prints TARGET MISSED with the bound."""
        assert not check_target("ratio", 1.2, at_most=1.1)
        assert check_target("ratio", 1.0, at_most=1.1)
        assert capsys.readouterr().out.splitlines() == [
            "TARGET MISSED: ratio 1.20 (target <= 1.10)",
            "target met: ratio 1.00 (target <= 1.10)",
        ]
