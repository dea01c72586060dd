"""SGLang's Triton kernels that read ``req_to_token`` and ``seq_lens`` on the decode path (FlashInfer's and the
Triton backend's kv indices, whole rows and sliding-window suffixes; the last slot of each row; FlashInfer's
sliding-window plan through vToken's hook, by logical position), run by the Triton
interpreter over rows vToken compacted and relocated behind late fences: ``tests/index_kernels_check.py``, in a
process of its own (Triton reads ``TRITON_INTERPRET`` when SGLang's kernels are defined)."""

import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.server


def test_index_kernels_read_compacted_rows():
    from vtoken_sglang.tools.launcher import cpu_env

    done = subprocess.run(
        [sys.executable, str(REPO / "tests/index_kernels_check.py")],
        env=cpu_env({"TRITON_INTERPRET": "1"}),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    checked = [line.split(":")[0] for line in done.stdout.splitlines() if "rows right" in line]
    assert checked == [
        "kv_indices",
        "kv_indices_window",
        "kv_indices_blocks",
        "last_loc",
        "flashinfer_window_plan",
        "flashinfer_window_fast_plan",
    ], done.stdout
