"""The host-read counter (``integration.host_reads``): what it counts as a device-to-host read, and what not."""

import torch

from vtoken_sglang.integration.observe import host_reads as mod


def test_counts_reads_not_upstream_calls_nor_host_arrays(monkeypatch):
    reads = mod.HostReads(enabled=True)  # as VTOKEN_SGLANG_COUNT_HOST_READS=1 does
    monkeypatch.setattr(mod, "HOST_READS", reads)
    t = torch.arange(8)

    def hook(x):
        bool(x[0]), int(x[1]), x.tolist(), x[x > 3], x.nonzero()  # five reads
        x.sum(), x + 1, x[2:5], torch.tensor([1, 2]), x.repeat_interleave(2)  # none: no data-sized output
        x.repeat_interleave(x, output_size=28)  # none: the size is given
        mod.host_array(x)  # SGLang's host tensor: not counted
        return x

    def upstream_of(original, x):
        return original(x) + int(x[0])  # one read of vToken's, the upstream call's own not counted

    plain = reads.counted("AFTER", hook)
    around = reads.counted("AROUND", upstream_of)
    plain(t)
    assert reads.step == 5 and reads.by_hook == {
        "hook": {"__bool__": 1, "__int__": 1, "tolist": 1, "__getitem__": 1, "nonzero": 1}
    }
    around(lambda x: int(x.sum()) + bool(x[0]), t)
    assert reads.step == 6 and reads.by_hook["upstream_of"] == {"__int__": 1}
    reads.end_step(("a",))
    reads.end_step(("a",))
    assert reads.metrics()["host_reads_quiet_steps"] == 1 and reads.metrics()["host_reads_busy_max"] == 6
    assert reads.metrics()["host_reads_quiet_max"] == 0
