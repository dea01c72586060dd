"""SGLang's Triton kernels that read ``req_to_token`` and ``seq_lens`` on the decode path (FlashInfer's and the
Triton backend's kv indices, whole rows and sliding-window suffixes; the last slot of each row; FlashInfer's
sliding-window plan through vToken's hook, by logical position), run by the Triton
interpreter over rows vToken compacted and relocated behind late fences: ``tests/index_kernels_check.py``; and
FlashInfer's extend plan over prompts evicted between prefill chunks: ``tests/extend_plan_check.py``. Each in a
process of its own (Triton reads ``TRITON_INTERPRET`` when SGLang's kernels are defined)."""

import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.server


def checked_by(script: str) -> list[str]:
    """Runs ``tests/<script>`` interpreted; the names of the checks it reports right."""
    from vtoken_sglang.tools.launcher import cpu_env

    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / script)],
        env=cpu_env({"TRITON_INTERPRET": "1"}),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [line.split(":")[0] for line in done.stdout.splitlines() if "rows right" in line]


def test_index_kernels_read_compacted_rows():
    checked = checked_by("index_kernels_check.py")
    assert checked == [
        "kv_indices",
        "kv_indices_window",
        "kv_indices_blocks",
        "last_loc",
        "flashinfer_window_plan",
        "flashinfer_window_fast_plan",
    ], checked


def test_flashinfer_extend_plan_over_chunk_evicted_rows():
    checked = checked_by("extend_plan_check.py")
    assert checked == [
        f"flashinfer_extend_{kind}_{path}" for kind in ("sliding", "full") for path in ("paged", "ragged")
    ]
