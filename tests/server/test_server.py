"""End to end on real SGLang (CPU, tiny model): a --enable-vtoken server answers /generate and refuses a bad request
alone; a server without the flag has no vToken hook and the same outputs; the offline sgl.Engine generates with
vToken keyword arguments. (The frontend programs of python/ and bench_serving run against an evicting vToken
server in test_cow.py.)"""

import json
import socket

import pytest
from conftest import PY, REPO, run_all

from vtoken_sglang.tools.launcher import (
    SglangServer,
    default_server_args,
    started_together,
)

pytestmark = pytest.mark.server

PROMPTS = ["The page table", "def evict(cache, budget):", "Memory is the scarce resource of serving. " * 12, "Hi"]


@pytest.fixture(scope="module")
def servers(tiny_model, tmp_path_factory):
    """A vToken server (no --page-size: vToken's default, 16, applies) and a plain one, started together."""
    vtoken = SglangServer(
        tiny_model,
        default_server_args(page_size=None) + ["--enable-vtoken"],
        log_path=tmp_path_factory.mktemp("vtoken") / "server.log",
    )
    # the plain server is given a port another process holds (as when a port is taken between free_port and the
    # bind, by a server starting at the same time): it starts again on a fresh port
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    plain = SglangServer(
        tiny_model,
        default_server_args(page_size=16),
        port=taken.getsockname()[1],
        log_path=tmp_path_factory.mktemp("plain") / "server.log",
    )
    with taken, started_together(vtoken, plain):
        assert plain.port != taken.getsockname()[1]
        yield vtoken, plain


@pytest.fixture(scope="module")
def vtoken_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def plain_server(servers):
    return servers[1]


def _ids(server, prompts, n=24):
    out = server.generate(prompts, n, ignore_eos=True)
    return [o["output_ids"] for o in out]


def test_generate_single_and_batched(vtoken_server):
    one = vtoken_server.generate("The page table maps", 16, ignore_eos=True)
    assert len(one["output_ids"]) == 16 and one["meta_info"]["finish_reason"]["type"] == "length"
    batched = _ids(vtoken_server, PROMPTS)
    assert [len(x) for x in batched] == [24] * len(PROMPTS)
    assert _ids(vtoken_server, PROMPTS) == batched  # greedy is deterministic
    assert [_ids(vtoken_server, [p])[0] for p in PROMPTS] == batched  # one at a time == batched


def test_server_runs_with_vtoken_config(vtoken_server):
    info = vtoken_server.get("/get_server_info")
    assert info["page_size"] == 16 and info["attention_backend"] == "torch_native"
    assert "[vtoken] scheduler tp_rank=0: vToken on: policy=none" in vtoken_server.log_text()


def test_bad_request_fails_alone(vtoken_server):
    import urllib.error

    with pytest.raises(urllib.error.HTTPError):
        vtoken_server.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": -3}})
    assert len(_ids(vtoken_server, ["still serving"], 4)[0]) == 4


def test_without_flag_no_vtoken_hook_and_same_outputs(plain_server, vtoken_server):
    log = plain_server.log_text()
    assert "[vtoken]" not in log and "plugin=vtoken" not in log.replace("Loaded plugin vtoken", "")
    assert _ids(plain_server, PROMPTS) == _ids(vtoken_server, PROMPTS)


def test_offline_engine_program():
    (run,) = run_all([[PY, str(REPO / "python/offline_engine.py"), "--prompts", "4", "--max-new-tokens", "8"]])
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert json.loads(result["vtoken_config"])["enable_vtoken"] is True and result["page_size"] == 16
    assert len(result["outputs"]) == 4 and all(1 <= len(o["output_ids"]) <= 8 for o in result["outputs"])
