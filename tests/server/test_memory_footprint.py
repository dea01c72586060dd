"""benchmark/memory_footprint.py: vToken's device bytes for real model geometries, computed by the code that
allocates them in the server, stay under 1% of the KV pool for every policy (it was up to 7% with row-aligned
metadata at 128K contexts); they grow with the pool, not with rows x context."""

import json

from conftest import PY, REPO, run_all


def test_memory_footprint_of_real_geometries(tmp_path):
    out = tmp_path / "footprint.json"
    (run,) = run_all([[PY, str(REPO / "benchmark" / "memory_footprint.py"), "--no-server", "--json", str(out)]])
    assert run.returncode == 0, run.stderr[-2000:]
    rec = json.loads(out.read_text())
    geos = rec["geometries"]
    assert {g["model"] for g in geos} == {"Llama-3.1-8B", "Qwen2.5-7B", "Mistral-7B"}
    assert {g["context"] for g in geos} == {8192, 32768, 131072} and len({g["policy"] for g in geos}) == 7
    assert rec["worst_pct"] <= 1.0 and "target <= 1%" in run.stdout
    for model in ("Llama-3.1-8B", "Qwen2.5-7B", "Mistral-7B"):  # the same pool: the same bytes at 8K and 128K
        h2o = {g["context"]: g for g in geos if g["model"] == model and g["policy"] == "h2o"}
        per_row = 49  # live_len, logical_len, row_key, offset, n_shared, shared base (int64), active (bool)
        grown = h2o[131072]["vtoken_device_bytes"] - h2o[8192]["vtoken_device_bytes"]
        assert grown == per_row * (h2o[131072]["rows"] - h2o[8192]["rows"])
        metadata = h2o[131072]["vtoken_device_bytes"] - h2o[131072]["query_buffer_bytes"]
        assert h2o[131072]["row_aligned_bytes"] > 100 * metadata
    # decode-scored policies add their query buffers: 256 rows x layers x query heads x head dim, bf16 (+ the stamp)
    llama = {g["policy"]: g["query_buffer_bytes"] for g in geos if g["model"] == "Llama-3.1-8B"}
    assert llama["h2o"] == llama["tova"] == llama["scissorhands"] == 256 * 32 * 32 * 128 * 2 + 8
    assert llama["snapkv"] == llama["random"] == llama["none"] == 0
