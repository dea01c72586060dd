"""Score policies inside CUDA graphs: decode queries written into the collector's static buffers by a captured graph.

Used by ``gpu_check.py`` (rows ``graph_queries`` and ``graph_scoring``); needs torch (and Triton on CUDA for the
scores), no sglang. A toy decoder stands in for SGLang's model (which does not run on the lent GPU): per layer it
projects the batch's hidden states to queries, keys and values, writes the keys into a paged KV pool at the batch's
new slots, calls ``ScoreCollector.keep_query`` as vToken's hook on ``RadixAttention.forward`` does, and mixes the
query back into the hidden state. Checks:

- ``graph_queries``: a CUDA graph captured at the largest batch and replayed over several decode steps with new
  inputs leaves the same query buffers and the same scores as an eager forward of the same inputs (bit for bit),
  and the device counts one written forward per replay. On CPU (no graphs) the eager forward against a per-step
  capture of the same queries.
- ``graph_scoring``: device time of a replay with and without the query writes, and of scoring one step
  (``ScoreCollector.scores``, Triton on CUDA) over a Llama-8B-like geometry, against the replayed step.
"""

from __future__ import annotations

import torch

from vtoken_sglang.scoring import ScoreCollector
from vtoken_sglang.scoring.collector import scores_impl


class ToyDecoder(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, q_heads: int, kv_heads: int, head_dim: int, slots: int, dtype, device):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        w = lambda o: (torch.randn(hidden, o, generator=g) * hidden**-0.5).to(dtype).to(device)  # noqa: E731
        self.wq = [w(q_heads * head_dim) for _ in range(layers)]
        self.wk = [w(kv_heads * head_dim) for _ in range(layers)]
        self.wo = [
            (torch.randn(q_heads * head_dim, hidden, generator=g) * 0.05).to(dtype).to(device) for _ in range(layers)
        ]
        self.k_pool = [torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.shape = (q_heads, kv_heads, head_dim)
        self.collector: ScoreCollector | None = None

    def forward(self, x: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
        Hq, Hkv, D = self.shape
        rows = x.shape[0]
        for layer, (wq, wk, wo) in enumerate(zip(self.wq, self.wk, self.wo)):
            q = x @ wq
            self.k_pool[layer].index_copy_(0, new_slots, (x @ wk).view(-1, Hkv, D))
            if self.collector is not None and layer in self.collector.layers:  # vToken's attention hook
                self.collector.keep_query(layer, q, True, Hq, D, D**-0.5, 0.0, rows_bound=lambda: rows)
            x = x + torch.tanh(q) @ wo
        return x


def make_collector(layers: int) -> ScoreCollector:
    return ScoreCollector(layers, "all")


def check(device: str) -> dict:
    """Graph replays against eager forwards (CUDA), or eager against a per-step capture (CPU); raises on a mismatch."""
    layers, hidden, Hq, Hkv, D, slots_n, max_bs = 3, 64, 4, 2, 16, 512, 8
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = ToyDecoder(layers, hidden, Hq, Hkv, D, slots_n, dtype, device)
    g = torch.Generator().manual_seed(2)
    steps = [(8, 40), (5, 41), (8, 42), (3, 43)]  # (batch, live tokens per row)
    graphed = make_collector(layers)
    eager = make_collector(layers)
    static_x = torch.zeros(max_bs, hidden, dtype=dtype, device=device)
    static_slots = torch.zeros(max_bs, dtype=torch.int64, device=device)
    graph = None
    if device == "cuda":
        model.collector = graphed
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(static_x, static_slots)  # warm-up (writes and counts once)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(static_x, static_slots)
        warm = graphed.buffers.written()
    replays = 0
    for B, W in steps:
        x = torch.randn(B, hidden, generator=g).to(dtype).to(device)
        new = torch.randperm(slots_n, generator=g)[:B].to(device)
        rows = torch.stack([torch.randperm(slots_n, generator=g)[:W] for _ in range(B)]).to(device)
        live = torch.randint(1, W + 1, (B,), generator=g).to(device)
        keys = lambda layer: model.k_pool[layer]  # noqa: E731
        if graph is not None:  # padded to the captured batch, as SGLang pads a decode batch
            static_x.zero_()
            static_x[:B] = x
            static_slots.fill_(slots_n - 1)
            static_slots[:B] = new
            graphed.begin_forward(True)
            graph.replay()
            replays += 1
            got = graphed.scores(keys, rows, live)
            model.collector = eager
            eager.begin_forward(True)
            model(x, new)
            want = eager.scores(keys, rows, live)
            same_q = torch.equal(graphed.buffers.q[:, :B], eager.buffers.q[:, :B])
        else:  # CPU: the eager forward's buffers against the queries of the forward kept per step
            kept: dict[int, torch.Tensor] = {}
            model.collector = eager
            eager.begin_forward(True)
            with_hook = model(x, new)
            model.collector = None
            h = x
            for layer, (wq, wo) in enumerate(zip(model.wq, model.wo)):
                kept[layer] = (h @ wq).view(B, Hq, D)
                h = h + torch.tanh(h @ wq) @ wo
            got = eager.scores(keys, rows, live)
            stacked = torch.stack([kept[layer] for layer in range(layers)])
            # the implementation the collector runs here (the CPU kernel where it is built), on the forward's queries
            impl = scores_impl(rows.device)
            want = impl(stacked, [keys(layer) for layer in range(layers)], rows, live, D**-0.5)
            want = want / (Hq * layers)
            same_q = torch.equal(torch.stack([kept[layer] for layer in range(layers)]), eager.buffers.q[:, :B])
            same_q = same_q and torch.equal(with_hook, h)
        if not same_q or not torch.equal(got, want):
            raise AssertionError(f"batch {B}: buffers or scores differ from the eager forward's")
    counted = graphed.buffers.written() - warm if graph is not None else eager.buffers.written()
    expected = replays if graph is not None else len(steps)
    if counted != expected:
        raise AssertionError(f"the device counted {counted} written forwards, {expected} ran")
    return {"steps": len(steps), "graph": graph is not None, "counted": counted}


def timing(device: str, repeats: int = 20) -> dict:
    """CUDA only: device ms of a replayed step with and without the query writes, and of scoring one step."""
    layers, Hq, Hkv, D, B, W = 32, 32, 8, 128, 64, 1024
    hidden, slots_n = 1024, B * W + B
    model = ToyDecoder(layers, hidden, Hq, Hkv, D, slots_n, torch.bfloat16, device)
    x = torch.randn(B, hidden, dtype=torch.bfloat16, device=device)
    new = torch.arange(B, device=device) + B * W
    rows = torch.arange(B * W, device=device).view(B, W)
    live = torch.full((B,), W, device=device)
    ms = {}
    for name, collector in (("step_ms", None), ("step_with_queries_ms", make_collector(layers))):
        model.collector = collector
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(x, new)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x, new)
        ms[name] = device_ms(graph.replay, repeats)
        if collector is not None:
            collector.begin_forward(True)
            graph.replay()
            keys = lambda layer: model.k_pool[layer]  # noqa: E731

            def score(c=collector, keys=keys):
                c.begin_forward(True)  # every decode step is scored (``every`` 1)
                c.scores(keys, rows, live)

            ms["scoring_ms"] = device_ms(score, repeats)
    ms.update(layers=layers, batch=B, live=W, q_heads=Hq, kv_heads=Hkv, head_dim=D)
    return ms


def device_ms(fn, repeats: int) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats
