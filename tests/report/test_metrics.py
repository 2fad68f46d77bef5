"""The end-of-run summary table."""

from pathlib import Path

from runner.report.metrics import summary_table


def test_summary_shows_mfu_as_a_percentage_and_skips_what_is_missing():
    table = summary_table({"train_loss": 6.8, "train_mfu": 0.2358, "peak_memory_mb": 2282.0, "eval_loss": None}, Path("/run"))
    lines = table.splitlines()
    assert any(line.split() == ["MFU", "23.58%"] for line in lines)
    assert any(line.split() == ["peak", "memory", "(MB/rank)", "2,282"] for line in lines)
    assert "eval loss" not in table and "outputs in /run" in table


def test_summary_says_unknown_when_the_mfu_cannot_be_known():
    table = summary_table({"train_loss": 6.8, "train_mfu": None}, Path("/run"))
    assert any(line.split() == ["MFU", "unknown"] for line in table.splitlines())


class _FakeCuda:
    """torch.cuda's memory counters for one device: reserved memory with a peak that
    reset_peak_memory_stats brings back to the current value (torch's semantics)."""

    def __init__(self) -> None:
        self.reserved, self.peak = 0, 0

    def hold(self, mib: int) -> None:
        self.reserved = mib * 2**20
        self.peak = max(self.peak, self.reserved)

    def install(self, monkeypatch) -> None:
        import torch

        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 0)  # must not be what we report
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.reserved))


def test_gpu_peak_memory_is_per_window_reserved_and_the_run_peak_survives(monkeypatch):
    import torch

    from runner.report import metrics

    monkeypatch.setattr(metrics, "_run_peak_mb", {})
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    device = torch.device("cuda", 0)
    cuda.hold(3000)
    cuda.hold(1000)
    assert metrics.window_peak_memory_mb(device) == 3000  # reserved, not allocated
    assert metrics.current_memory_mb(device) == 1000
    cuda.hold(1500)
    assert metrics.window_peak_memory_mb(device) == 1500  # the first window's peak is gone
    assert metrics.peak_memory_mb(device) == 3000  # the whole run's peak is kept


def test_a_new_run_in_the_same_process_starts_its_gpu_peak_afresh(monkeypatch):
    """A one-process sweep's next job: the peak the job before it reached is not its own."""
    import torch

    from runner.report import metrics

    monkeypatch.setattr(metrics, "_run_peak_mb", {})
    cuda = _FakeCuda()
    cuda.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the job before used the GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    live_mib = 200
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: cuda.hold(live_mib))  # the cache handed back to the driver
    device = torch.device("cuda", 0)
    cuda.hold(3000)  # the first job's large batch
    metrics.window_peak_memory_mb(device)  # its tensors are freed, but the caching allocator keeps 3000 reserved
    metrics.reset_peak_memory()
    cuda.hold(500)  # the second job's own peak
    assert metrics.peak_memory_mb(device) == 500


def test_a_fresh_process_makes_no_cuda_call_to_reset_its_peak(monkeypatch):
    """No earlier run used CUDA: nothing to reset, and no context made on any device."""
    import torch

    from runner.report import metrics

    def forbidden(*args, **kwargs):
        raise AssertionError("a CUDA call in a process that has not used CUDA")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("is_available", "empty_cache", "device_count", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    metrics.reset_peak_memory()


def test_a_new_run_in_the_same_process_starts_its_cpu_peak_afresh():
    from runner.report import metrics

    big = bytearray(400 * 2**20)
    big[:: 4096] = b"x" * len(big[:: 4096])  # touched: resident
    assert metrics.peak_memory_mb() > 400
    del big
    metrics.reset_peak_memory()
    assert metrics.peak_memory_mb() < metrics.current_memory_mb() + 50  # the peak is now, not the 400 MB before
