"""SGLang's GPU attention path on CPU: vToken under SGLang's Triton attention backend, whose kernels (extend and
decode attention, the kv indices gathered from ``req_to_token``, the last slot of each row) run under the Triton
interpreter (``TRITON_INTERPRET=1``).

vToken with relocation, copy-on-write of the prompts' tree pages, late fences (conftest) and SGLang's overlap
scheduler (its default) on: each policy's outputs on the Triton backend equal the same configuration on
``torch_native``, with the same victims, and Naive-Evict's; nothing leaks (SGLang's strict idle check).
Relocation plans are not compared across servers: their page ids follow the order SGLang admitted the requests in.
h2o on the Triton backend, with vToken's own Triton scoring kernel interpreted, is ``test_sliding_windows``'s
(against transformers); the kernel against the torch reference is ``test_scoring``'s. Loads are short, one request
of 4 prompts each: an interpreted decode step costs about 0.3 s.
"""

import pytest
from conftest import STRICT, idle_states, on_servers

from vtoken_sglang.tools.launcher import SglangServer, default_server_args

pytestmark = pytest.mark.server

BUDGET = ["--vtoken-budget", "32", "--vtoken-recent", "8", "--vtoken-sinks", "4"]
# prompts that share their first pages (the tree holds them once)
TEXT = "Reclaim moves live tokens out of sparse pages. "
PROMPTS = {"random": [TEXT * (2 + i % 3) + str(i) for i in range(4)]}
NEW_TOKENS = 32
# two KV splits: the decode kernel's split and merge both run (SGLang's default, 8, costs 4x the interpreted work)
TRITON = default_server_args(4096, cpu_attention="triton") + ["--triton-attention-num-kv-splits", "2"]
CONFIGS = {
    "triton": (TRITON, "on", {**STRICT, "TRITON_INTERPRET": "1"}),
    "native": (default_server_args(4096), "on", STRICT),
    "naive": (default_server_args(4096), "off", STRICT),
}


@pytest.fixture(scope="module")
def triton_runs(tiny_model):
    """(policy, backend) -> (outputs, idle vToken state, log) on the three configurations."""
    servers = {
        (policy, name): SglangServer(
            tiny_model,
            args + ["--enable-vtoken", "--vtoken-policy", policy, "--vtoken-reclaim", reclaim] + BUDGET,
            env=env,
        )
        for policy in PROMPTS
        for name, (args, reclaim, env) in CONFIGS.items()
    }

    def run(key, s: SglangServer) -> tuple:
        out = s.generate(PROMPTS[key[0]], NEW_TOKENS, ignore_eos=True)
        return [o["output_ids"] for o in out], idle_states(s)[0], s.log_text()

    return on_servers(servers, run)


@pytest.mark.parametrize("policy", list(PROMPTS))
def test_triton_backend_equals_torch_native_and_naive_evict(triton_runs, policy):
    """The Triton backend, interpreted: the same tokens and victims as torch_native (vToken) and as Naive-Evict;
    it evicted, relocated and copied tree pages (the prompts share them); positions checked, nothing leaked, the
    integrity check ran."""
    (ids, st, log), (ids_native, st_native, _) = triton_runs[policy, "triton"], triton_runs[policy, "native"]
    assert "'attention_backend': 'triton'" in log and "'disable_overlap_schedule': False" in log
    assert ids == ids_native, policy
    assert st["tokens_evicted"] == st_native["tokens_evicted"] > 0
    assert st["digest_victims"] == st_native["digest_victims"]
    ids_naive, st_naive, _ = triton_runs[policy, "naive"]
    assert ids == ids_naive and st["digest_victims"] == st_naive["digest_victims"]
    assert st["tokens_moved"] > 0 and st["pages_reclaimed"] > 0
    assert st["cow_copies"] > 0 and st["cow_pages_released"] > 0, st
    assert st["position_checks"] > 0 and st["position_mismatches"] == 0 and st["integrity_checks"] > 0
    assert st["live_tokens"] == 0 and st["allocated_pages"] == 0 and st["pending_pages"] == 0
    assert "memory leak" not in log and "Traceback" not in log
