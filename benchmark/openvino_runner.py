"""One load on OpenVINO GenAI's continuous batching pipeline, run by ``peer_openvino.py`` with the Python of
``.venv-openvino`` (it imports only the standard library and ``openvino_genai``).

    .venv-openvino/bin/python benchmark/openvino_runner.py IR_DIR LOAD_JSON [--budget N] > run.json

``LOAD_JSON``: ``{"prompts": [token ids, ...], "output_lens": [...], "pool_tokens": N}``. Every request is added
at once (greedy, ``ignore_eos``, exactly its output length), then the pipeline is stepped until all end; after each
step the pipeline's metrics give the requests it scheduled and its cache usage (blocks in use over the pool's). The
KV pool is ``pool_tokens`` in blocks of ``BLOCK`` tokens (OpenVINO's CPU block). ``--budget N``: OpenVINO's cache
eviction with ``max_cache_size`` N (H2O-style scores summed, whole blocks evicted, ``BLOCK`` sink tokens and
``2 x BLOCK`` recent ones kept; its cache rotation off, as it assumes rope_theta 1e4 and SmolLM2 has 1e5). Prints
one JSON object: the most scheduled at once, the highest cache usage and its mean over the steps (prompt chunks
included; also as blocks held), each request's output token ids, the wall time. Preemptions are not in it: the
pipeline's metrics (``PipelineMetrics``: requests, scheduled_requests, cache usage now / max / running average,
cache bytes, la_peak_pool_blocks) count none, and a request's ``GenerationStatus`` has no preempted state."""

from __future__ import annotations

import argparse
import json
import sys
import time

BLOCK = 32  # OpenVINO's KV block on CPU (tokens)


def scheduler_config(pool_tokens: int, budget: int | None):
    import openvino_genai as ov_genai

    cfg = ov_genai.SchedulerConfig()
    cfg.num_kv_blocks = pool_tokens // BLOCK
    cfg.max_num_batched_tokens = max(pool_tokens, 256)
    cfg.dynamic_split_fuse = True
    cfg.enable_prefix_caching = False
    if budget is not None:
        cfg.use_cache_eviction = True
        cfg.cache_eviction_config = ov_genai.CacheEvictionConfig(
            start_size=BLOCK,
            recent_size=2 * BLOCK,
            max_cache_size=budget,
            aggregation_mode=ov_genai.AggregationMode.SUM,
            apply_rotation=False,
        )
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ir_dir")
    ap.add_argument("load_json")
    ap.add_argument("--budget", type=int, help="OpenVINO's cache eviction at this max_cache_size (tokens)")
    args = ap.parse_args(argv)
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    load = json.loads(open(args.load_json).read())
    pipe = ov_genai.ContinuousBatchingPipeline(
        args.ir_dir, scheduler_config(load["pool_tokens"], args.budget), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    handles = []
    for i, (ids, n) in enumerate(zip(load["prompts"], load["output_lens"])):
        gen = ov_genai.GenerationConfig()
        gen.max_new_tokens, gen.min_new_tokens, gen.ignore_eos = n, n, True
        handles.append(pipe.add_request(i, ov.Tensor(np.array([ids], dtype=np.int64)), gen))
    most, usages = 0, []
    t0 = time.monotonic()
    while pipe.has_non_finished_requests():
        pipe.step()
        metrics = pipe.get_metrics()
        most = max(most, metrics.scheduled_requests)
        usages.append(metrics.cache_usage / 100.0)  # the metrics give percent
    wall = time.monotonic() - t0
    outputs = [h.read_all()[0].generated_ids for h in handles]
    mean = sum(usages) / max(len(usages), 1)
    running_mean = pipe.get_metrics().avg_cache_usage / 100.0  # the pipeline's own (over its last 1000 steps)
    json.dump(
        {
            "max_running_requests": most,
            "peak_cache_usage": round(max(usages, default=0.0), 3),
            "mean_cache_usage": round(mean, 3),
            "mean_held_blocks": round(mean * (load["pool_tokens"] // BLOCK), 1),
            "pipeline_avg_cache_usage": round(running_mean, 3),
            "steps": len(usages),
            "wall_s": round(wall, 1),
            "output_throughput": round(sum(len(o) for o in outputs) / wall, 1),
            "ids": outputs,
        },
        sys.stdout,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
