"""Attention scores of the newest query over the live keys (vtoken_sglang.scoring): equal to the attention
probabilities Hugging Face transformers reports (eager attention, ``output_attentions=True``), reduced over heads
the same way, for the tiny model (random weights, GQA) and SmolLM2-135M-Instruct (pretrained, 9 query / 3 KV
heads: its attention picks out tokens, so a score landing one position off would show); a compacted (evicted) live
row handled; collected in the real server, where the score-based policies run end to end."""

import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import STRICT, on_servers
from own_policy import SPEC

from vtoken_sglang.policies import scored
from vtoken_sglang.scoring import decode_scores_headsum

_rng = random.Random(3)
TURN = list(range(100, 177))  # the two-turn conversation's first prompt (77 tokens)
# the last prompt is shorter than a page: no tree prefix, so the request's release hands SGLang one page
PROMPT_IDS = [[_rng.randrange(10, 2000) for _ in range(40 + 23 * i)] for i in range(6)] + [[11, 12, 13, 14, 15]]
SYSTEM = [_rng.randrange(10, 2000) for _ in range(160)]  # a system prompt (10 pages) and six questions on it
QUESTIONS = [[_rng.randrange(10, 2000) for _ in range(12)] for _ in range(6)]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def hf_run(request, tiny_model):
    """One forward in transformers, of the tiny model on random ids or of SmolLM2 on a pass-key prompt of ~200
    tokens asking at the end: per layer, HF's probabilities and the q/k it attended with; and where the pass key's
    digits stand in the prompt (SmolLM2; None for the tiny model)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from vtoken_sglang.tools import text_tasks

    captured = []

    def capture(module, query, key, value, attention_mask, **kwargs):
        captured.append((query.detach().clone(), key.detach().clone()))
        if attention_mask is None:  # transformers leaves causality to a custom kernel: give eager its mask
            T = query.shape[2]
            attention_mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("vtoken_capture", capture)
    key = None
    if request.param == "tiny":
        path, ids = tiny_model, torch.randint(10, 2000, (1, 77), generator=torch.Generator().manual_seed(0))
    else:
        path = request.getfixturevalue("smollm2")
        tok = AutoTokenizer.from_pretrained(path)
        prompt = text_tasks.passkey_prompt(tok, 200, random.Random(1), question_first=False)
        digits, ids = tok.encode(prompt.answer, add_special_tokens=False), prompt.ids
        at = next(i for i in range(len(ids)) if ids[i : i + len(digits)] == digits)
        key, ids = slice(at, at + len(digits)), torch.tensor([ids])
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="vtoken_capture")
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    return model.config, captured, [a[0] for a in out.attentions], key  # per layer [Hq, T (queries), T (keys)]


def _as_pool(key: torch.Tensor, seed: int):
    """Scatter HF's keys ``[1, Hkv, T, D]`` into a shuffled slot pool, as a paged KV buffer holds them."""
    T = key.shape[2]
    perm = torch.randperm(T + 40, generator=torch.Generator().manual_seed(seed))[:T]
    pool = torch.randn(T + 40, key.shape[1], key.shape[3])  # garbage in the unused slots
    pool[perm] = key[0].transpose(0, 1)
    return pool, perm


def test_scores_equal_hf_attention_probabilities(hf_run):
    cfg, captured, probs, key = hf_run
    scale = cfg.head_dim**-0.5
    assert cfg.num_attention_heads != cfg.num_key_value_heads  # GQA: query heads summed onto their KV head's keys
    on_key = []
    for layer, ((q, k), p) in enumerate(zip(captured, probs)):
        p = p[:, -1, :]  # the newest query
        pool, slots = _as_pool(k, seed=layer)
        got = decode_scores_headsum(q[0, :, -1, :][None], pool, slots[None], torch.tensor([k.shape[2]]), scale)
        torch.testing.assert_close(got[0], p.sum(0), rtol=1e-4, atol=1e-6)
        assert got[0].sum().item() == pytest.approx(cfg.num_attention_heads, rel=1e-5)
        on_key.append(float(got[0][key].sum()) / cfg.num_attention_heads if key else 0.0)
    if key:  # the last query (`The pass key is`) puts over a tenth of its attention on the key's 5 digits of ~200
        assert max(on_key) > 0.1, on_key


def test_live_row_subset_and_batch(hf_run):
    """A compacted row (only some tokens live, in logical order) renormalizes over the live set; rows of a batch
    with different lengths are independent."""
    cfg, captured, *_ = hf_run
    scale = cfg.head_dim**-0.5
    q, k = captured[1]
    T = k.shape[2]
    pool, slots = _as_pool(k, seed=5)
    live = torch.tensor(
        sorted(torch.randperm(T - 1, generator=torch.Generator().manual_seed(1))[:30].tolist()) + [T - 1]
    )
    qn = q[0, :, -1, :]
    rows = torch.zeros(2, T, dtype=torch.int64)
    rows[0, : len(live)] = slots[live]
    rows[1] = slots
    got = decode_scores_headsum(torch.stack([qn, qn]), pool, rows, torch.tensor([len(live), T]), scale)
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    kk = k[0][:, live].repeat_interleave(group, 0)  # [Hq, L, D]
    want = torch.softmax(torch.einsum("hd,hld->hl", qn, kk) * scale, -1).sum(0)
    torch.testing.assert_close(got[0, : len(live)], want, rtol=1e-4, atol=1e-6)
    assert bool((got[0, len(live) :] == 0).all())
    assert got[1].sum().item() == pytest.approx(cfg.num_attention_heads, rel=1e-5)


def test_snapkv_window_scores_equal_hf(hf_run):
    """SnapKV's prefill scores through the collector (the window's rows picked out of a two-request extend batch,
    each request's keys read through its row): equal to transformers' probabilities of the last w queries, summed
    over them, mean over heads and layers; the second request has a cached prefix (its positions start there)."""
    from vtoken_sglang.scoring import ScoreCollector

    cfg, captured, probs, _ = hf_run
    T, w, prefix = captured[0][1].shape[2], 8, 30
    layers = len(captured)
    pools = [_as_pool(k, seed=7) for _, k in captured]  # one seed: a token has the same slot in every layer
    perm = pools[0][1]
    col = ScoreCollector(layers, "all", decode=False, prefill_window=w)
    col.begin_forward(True)
    assert not col.active  # snapkv scores no decode step
    # request A: the whole prompt extended; request B: the same prompt with `prefix` tokens cached
    col.begin_forward(False, [T, T - prefix], [0, prefix], key="AB")
    for layer, (q, _) in enumerate(captured):
        rows = q[0].transpose(0, 1).reshape(T, -1)  # [T, Hq * D], the engine's layout
        col.keep_query(
            layer, torch.cat([rows, rows[prefix:]]), False, cfg.num_attention_heads, cfg.head_dim, cfg.head_dim**-0.5
        )
    col.begin_forward(True)  # the next forward runs before the prefill's results are processed (overlap)
    window = col.take_window("AB")
    got = col.window_scores(window, lambda layer: pools[layer][0], [perm, perm])
    want = torch.stack([p[:, -w:, :].sum(1).mean(0) for p in probs]).mean(0)
    for g in got:
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    assert col.prefill_forwards_scored == 1 and col.take_window("AB") is None


def test_static_query_buffers_equal_the_per_step_capture():
    """Decode queries written into the collector's static buffers (what a CUDA graph's replay refills) give the
    scores the per-step capture gave (the queries of that forward scored directly), bit for bit in float32:
    over steps whose batch shrinks (rows past the batch hold an older step's queries and are not read), with every
    other step scored, and for a batch larger than the buffers (an eager forward keeps its query instead). The
    buffers are counted on the device once per decode forward; a forward that wrote none is seen."""
    from vtoken_sglang.scoring import ScoreCollector
    from vtoken_sglang.scoring.collector import scores_impl

    g = torch.Generator().manual_seed(5)
    layers, Hq, Hkv, D, slots_n = 3, 4, 2, 16, 200
    keys = [torch.randn(slots_n, Hkv, D, generator=g) for _ in range(layers)]
    col = ScoreCollector(layers, "0,-1", every=2)
    scored = sorted(col.layers)
    for step, (B, W) in enumerate([(5, 40), (5, 41), (3, 42), (3, 43), (7, 44)]):
        col.begin_forward(True)
        qs = {layer: torch.randn(B, Hq * D, generator=g) for layer in range(layers)}
        for layer in scored:  # the attention hook, with buffers sized for 6 requests
            col.keep_query(layer, qs[layer], True, Hq, D, D**-0.5, 0.0, rows_bound=lambda: 6)
        slots = torch.stack([torch.randperm(slots_n, generator=g)[:W] for _ in range(B)])
        live = torch.randint(1, W + 1, (B,), generator=g)
        got = col.scores(lambda layer: keys[layer], slots, live)
        if step % 2:
            assert got is None  # every other step is scored
            continue
        kept = torch.stack([qs[layer].view(B, Hq, D) for layer in scored])  # the queries of the forward itself
        want = scores_impl(slots.device)(kept, [keys[layer] for layer in scored], slots, live, D**-0.5)
        assert torch.equal(got, want / (Hq * len(scored))), step
        per_layer = sum(
            decode_scores_headsum(kept[i], keys[layer], slots, live, D**-0.5) for i, layer in enumerate(scored)
        )
        torch.testing.assert_close(got, per_layer / (Hq * len(scored)), rtol=1e-6, atol=1e-7)  # layers at once
    assert col.buffers.rows == 6 and col.steps_scored == 3 and col.decode_forwards_unwritten() == 0
    col.begin_forward(True)  # a forward whose layers wrote nothing (a graph captured without the hook)
    assert col.decode_forwards_unwritten() == 1
    # writes before counting starts (a graph capture's eager warm-ups) do not hide a forward that wrote nothing
    warm = ScoreCollector(layers, "all")
    for _ in range(3):
        for layer in range(layers):
            warm.keep_query(layer, torch.randn(2, Hq * D), True, Hq, D, D**-0.5)
    warm.start_counting()
    warm.begin_forward(True)
    assert warm.decode_forwards_unwritten() == 1


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the CPU kernel")
def test_cpu_kernel_equals_the_reference():
    """The CPU scoring kernel (built here: this machine has a compiler) is what CPU scoring runs, and gives the
    torch reference's scores up to float32 rounding: in each dtype, with GQA groups of 1, 2, 4 and 8, head dims of
    8 to 128 (those fixed at compile time and others), a logit cap, int32 and int64 slots, live lengths of 0, 1, the
    width and past it, a strided slice of the query buffers, one layer and three. A K buffer in another dtype than
    the queries (an fp8 cache) is scored by the reference."""
    from vtoken_sglang.scoring import cpu_kernel
    from vtoken_sglang.scoring.collector import scores_impl
    from vtoken_sglang.scoring.reference import layers_scores_headsum

    kernel = cpu_kernel.load()
    assert kernel is not None and scores_impl(torch.device("cpu")) is kernel
    g = torch.Generator().manual_seed(11)
    cases = [  # (layers, B, Hq, Hkv, D, W, dtype, cap, slot dtype)
        (2, 16, 4, 2, 32, 170, torch.bfloat16, 0.0, torch.int32),
        (3, 5, 8, 1, 16, 33, torch.float32, 30.0, torch.int64),
        (1, 7, 4, 4, 64, 9, torch.float16, 0.0, torch.int32),
        (1, 3, 8, 2, 128, 40, torch.bfloat16, 0.0, torch.int64),
        (2, 300, 2, 2, 8, 20, torch.float32, 0.0, torch.int32),  # large enough to run requests in parallel
    ]
    for L, B, Hq, Hkv, D, W, dtype, cap, slot_dtype in cases:
        q = torch.randn(L, B + 3, Hq, D, generator=g).to(dtype)[:, :B]  # the buffers' rows past the batch
        keys = [torch.randn(500, Hkv, D, generator=g).to(dtype) for _ in range(L)]
        slots = torch.randint(1, 500, (B, W), generator=g).to(slot_dtype)
        live = torch.randint(0, W + 4, (B,), generator=g)
        live[:3] = torch.tensor([0, 1, W])
        want = layers_scores_headsum(q, keys, slots, live, D**-0.5, cap)
        got = kernel(q, keys, slots, live, D**-0.5, cap)
        assert got.dtype == torch.float32 and got.shape == (B, W)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(got[0], torch.zeros(W))  # no live key: 0, as the reference
    q, keys = torch.randn(1, 4, 4, 16, generator=g), [torch.randn(50, 2, 16, generator=g).to(torch.bfloat16)]
    slots, live = torch.randint(1, 50, (4, 10), generator=g), torch.full((4,), 10)
    assert torch.equal(kernel(q, keys, slots, live, 0.25), layers_scores_headsum(q, keys, slots, live, 0.25))


def test_cpu_scoring_falls_back_to_the_reference(tmp_path):
    """Switched off, or where they cannot be built (here: no compiler found, in an empty extensions folder), CPU
    scoring uses the torch reference and the Token Table its torch ops, and one line says so."""
    check = (
        "import logging, torch; logging.basicConfig(level=logging.INFO, format='%(message)s'); "
        "from vtoken_sglang.scoring.collector import scores_impl; "
        "from vtoken_sglang.scoring.reference import layers_scores_headsum as ref; "
        "assert scores_impl(torch.device('cpu')) is ref; "
        "from vtoken_sglang.core.pages import PagePool; from vtoken_sglang.core.token_table import TokenTable; "
        "assert TokenTable(2, 8, PagePool(4, 4)).kernels is None"
    )
    env = {**os.environ, "VTOKEN_SGLANG_CPU_KERNEL": "0"}
    off = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and "CPU kernels off" in off.stderr, off.stderr[-2000:]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "CXX": str(tmp_path / "no-compiler")}
    broken = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
    assert broken.returncode == 0, broken.stderr[-2000:]
    assert "CPU kernels not built" in broken.stderr and "use torch ops" in broken.stderr


TRITON_CHECK = """
import torch
from vtoken_sglang.scoring.reference import decode_scores_headsum
from vtoken_sglang.scoring.triton_scores import decode_scores_headsum_triton
g = torch.Generator().manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(3, 4, 2, 32, 50, 16), (2, 6, 2, 24, 37, 16), (2, 8, 8, 16, 5, 32), (4, 32, 8, 128, 70, 32)]
for B, Hq, Hkv, D, W, block in SHAPES:
    k = torch.randn(300, Hkv, D, generator=g)
    slots = torch.stack([torch.randperm(300, generator=g)[:W] for _ in range(B)])
    live = torch.randint(1, W + 1, (B,), generator=g)
    live[-1] = 0 if B > 3 else live[-1]  # an empty row gives zeros in both
    q = torch.randn(B, Hq, D, generator=g)
    want = decode_scores_headsum(q, k, slots, live, D ** -0.5)
    got = decode_scores_headsum_triton(q.to(device), k.to(device), slots.to(device), live.to(device), D ** -0.5,
                                       block_w=block).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_triton_kernel_equals_reference():
    """The Triton kernel against the torch reference: natively on CUDA, under TRITON_INTERPRET=1 elsewhere (GQA
    groups of 1, 2, 3 and 4 heads, head dims that are not powers of two, partial blocks, an empty row)."""
    pytest.importorskip("triton")
    from conftest import PY, run_all

    env = {} if torch.cuda.is_available() else {"TRITON_INTERPRET": "1"}
    (run,) = run_all([[PY, "-c", TRITON_CHECK]], env=env, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


def hf_mean_attention(model, ids: list[int], window: int = 0) -> torch.Tensor:
    """transformers' attention over all positions, mean over heads and layers: of the last position, or (window)
    summed over the last ``window`` positions (SnapKV's observation window)."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_attentions=True)
    queries = slice(-window, None) if window else slice(-1, None)
    return torch.stack([a[0, :, queries, :].sum(1).mean(0) for a in out.attentions]).mean(0)


AT_PREFILL = scored("prefill")  # the built-in policies scored once per prompt (snapkv), the others at decode
SCORE_POLICIES = tuple(p for p in scored("decode", "prefill") if p != "h2o")  # h2o: built in and as SPEC, below
# servers run with SGLang's overlap scheduler off: Naive-Evict for tova, scissorhands and h2o (written in a test
# module); their vToken counterparts (and h2o built in) run with it on
SERIAL = {("tova", "off"), ("scissorhands", "off"), (SPEC, "off")}
TWO_TURNS = {("tova", "off"), ("snapkv", "off"), ("h2o", "on")}  # a two-turn conversation before the load


@pytest.fixture(scope="module")
def score_servers(tiny_model, tmp_path_factory):
    """tova, scissorhands and snapkv with reclaim off (Naive-Evict) and on, and h2o built in (reclaim on) and
    written in a test module (``own_policy.SPEC``, served through ``--vtoken-policy`` from PYTHONPATH; reclaim off),
    all at budget 96, with SGLang's overlap scheduler on except ``SERIAL``: the same load on each; first, on the
    reclaim-off tova and snapkv servers the scores they collect, and on ``TWO_TURNS`` a two-turn conversation;
    after the load, the shared-prefix load of ``isolation``. ``(policy, reclaim)`` -> (outputs, vToken state, log),
    the dumps, the cached counts, and ``(policy, reclaim)`` -> ``isolation``'s results."""
    from vtoken_sglang.tools.launcher import SglangServer, default_server_args

    tmp_path = tmp_path_factory.mktemp("scores")
    configs = [(policy, reclaim) for policy in SCORE_POLICIES for reclaim in ("off", "on")]
    configs += [("h2o", "on"), (SPEC, "off")]
    servers, dump_of = {}, {}
    for policy, reclaim in configs:
        flags = default_server_args() + [
            "--enable-vtoken",
            "--vtoken-policy",
            policy,
            "--vtoken-budget",
            "96",
            "--vtoken-recent",
            "8",
            "--vtoken-reclaim",
            reclaim,
        ]
        if (policy, reclaim) in SERIAL:
            flags.append("--disable-overlap-schedule")
        if policy in AT_PREFILL:
            flags += ["--vtoken-window", "8"]  # radix cache on: its prompt pages go by copy-on-write
        env = {**STRICT, "PYTHONPATH": str(Path(__file__).parents[1])} if policy == SPEC else STRICT
        if reclaim == "off" and policy in ("tova", "snapkv"):
            dump_of[policy] = tmp_path / f"{policy}-{reclaim}.pt"
            env = {**STRICT, "VTOKEN_SGLANG_SCORE_DUMP": str(dump_of[policy])}
        servers[policy, reclaim] = SglangServer(tiny_model, flags, env=env)
    dumps, cached, isolated = {}, {}, {}

    def run(config: tuple[str, str], s: SglangServer) -> tuple:
        policy, reclaim = config
        if reclaim == "off" and policy in dump_of:  # 77 + 6 tokens < 96 + slack: scores over the full sequence
            dump = dump_of[policy]
            s.post("/generate", {"input_ids": TURN, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
            deadline, steps = time.monotonic() + 30, []  # the server writes the dump when it goes idle
            while not (steps and steps[0][0][: len(TURN)] == TURN) and time.monotonic() < deadline:
                time.sleep(0.5)
                steps = torch.load(dump) if dump.exists() else []
            dumps[policy] = steps
        if config in TWO_TURNS:
            # a two-turn conversation under budget: its first turn (prompt and output) was never evicted from, so
            # it was inserted into the radix tree whole, as plain SGLang inserts it
            first = s.post(
                "/generate", {"input_ids": TURN, "sampling_params": {"max_new_tokens": 9, "temperature": 0.0}}
            )
            turn = TURN + first["output_ids"] + [7, 8, 9]
            second = s.post(
                "/generate", {"input_ids": turn, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}}
            )
            cached[policy] = second["meta_info"]["cached_tokens"]
        sampling = {"max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}
        out = s.post("/generate", {"input_ids": PROMPT_IDS, "sampling_params": sampling})
        time.sleep(2)
        state = s.get("/get_server_info")["internal_states"][0]["vtoken"]
        isolated[config] = isolation(s)
        return [o["output_ids"] for o in out], state, s.log_text()

    items, runs = list(servers.items()), {}
    for at in range(0, len(items), 4):  # 4 at a time: memory
        runs.update(on_servers(dict(items[at : at + 4]), run))
    return runs, dumps, cached, isolated


def isolation(s) -> dict:
    """Requests reading one system prompt: SYSTEM + question 0 alone (cold: nothing cached), then with the five
    other questions in one batch (SYSTEM from the radix tree, read by six requests at once), then alone again
    (warm); then a nested fork program (branches, and branches of branches, reading each other's prefixes), run
    twice (the second on a warm tree). Each prompt is over budget from its first decode step."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "python"))
    import multi_turn_fork

    sampling = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    alone, together, again = (
        s.post("/generate", {"input_ids": ids, "sampling_params": sampling})
        for ids in (SYSTEM + QUESTIONS[0], [SYSTEM + q for q in QUESTIONS], SYSTEM + QUESTIONS[0])
    )
    forks = [multi_turn_fork.run(s.url, ["memory pages"], branches=2, max_tokens=16, nested=2) for _ in range(2)]
    time.sleep(2)
    return {
        "alone": alone["output_ids"],
        "together": [o["output_ids"] for o in together],
        "again": again["output_ids"],
        "cached": [o["meta_info"]["cached_tokens"] for o in [alone, *together, again]],
        "forks": forks,
        "state": s.get("/get_server_info")["internal_states"][0]["vtoken"],
        "log": s.log_text(),
    }


@pytest.mark.server
def test_server_collects_hf_equal_scores_and_score_policies_are_transparent(score_servers, tiny_model):
    """In the real server: (1) the scores collected for a decoding request (tova) and SnapKV's prefill window
    scores equal transformers' attention probabilities for the same tokens; (2) for tova, scissorhands and snapkv
    (radix cache on: snapkv's prompt victims leave the tree's pages by copy-on-write), Naive-Evict and vToken give
    identical greedy tokens, vToken holds fewer pages, nothing leaks; (3) a request managed by a score policy that
    never evicted (tova, snapkv, h2o under budget) is inserted into the radix tree: the next turn hits the cache on
    its output. (h2o also runs in test_tp: TP 2, scores summed over the ranks.)"""
    from transformers import AutoModelForCausalLM

    runs, dumps, cached, _ = score_servers
    # 77 + 9 tokens: 5 whole pages in the tree after the first turn, against 4 from its prompt alone
    assert cached == {"tova": 80, "snapkv": 80, "h2o": 80}, cached
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32, attn_implementation="eager")
    assert [len(seen) for seen, _ in dumps["tova"]] == [78, 79, 80, 81]
    for seen, got in dumps["tova"]:
        torch.testing.assert_close(got, hf_mean_attention(hf, seen), rtol=1e-3, atol=1e-5)
    assert [seen for seen, _ in dumps["snapkv"]] == [TURN]  # one prefill scored, decode steps not
    torch.testing.assert_close(dumps["snapkv"][0][1], hf_mean_attention(hf, TURN, window=8), rtol=1e-3, atol=1e-5)
    # every prompt a snapkv server was sent was scored in its prefill (SGLang's own warm-up request at start, the
    # dump, the two turns, then the load); every scored decode step of the others kept its queries
    for reclaim, sent in (("off", 1 + 3 + len(PROMPT_IDS)), ("on", 1 + len(PROMPT_IDS))):
        st = runs["snapkv", reclaim][1]
        assert st["prefills_scored"] == sent and st["prefills_unscored"] == 0, (reclaim, st)
    for (policy, reclaim), (_, st, log) in runs.items():
        if policy not in AT_PREFILL:
            assert st["steps_scored"] > 0 and st["steps_unscored"] == 0, (policy, reclaim)
            assert "[vtoken] CPU kernels ready" in log, (policy, reclaim)  # not the torch ops
    for policy in SCORE_POLICIES:
        (ids_off, st_off, log_off), (ids_on, st_on, log_on) = runs[policy, "off"], runs[policy, "on"]
        assert st_off["tokens_evicted"] == st_on["tokens_evicted"] > 0, policy
        assert st_off["digest_victims"] == st_on["digest_victims"], policy
        assert ids_off == ids_on, policy
        if policy in AT_PREFILL:  # prompt victims: their tree pages go by copy-on-write, the copies are tracked pages
            assert st_on["cow_pages_released"] > 0 and st_on["peak_held_pages"] < st_off["peak_held_pages"]
        else:
            assert st_on["peak_tracked_pages"] < st_off["peak_tracked_pages"], policy
        assert st_on["pages_reclaimed"] > 0, policy
        for st, log in ((st_off, log_off), (st_on, log_on)):
            assert st["live_tokens"] == 0 and st["allocated_pages"] == 0 and st["position_mismatches"] == 0, policy
            assert "memory leak" not in log and "Traceback" not in log, policy


@pytest.mark.server
def test_score_policies_with_the_overlap_scheduler_on_and_off(score_servers):
    """h2o, tova and scissorhands keep SGLang's overlap scheduler on (each step is scored before the next forward is
    launched): with it on (vToken) and off (Naive-Evict; h2o: the same ranking written in a test module, reclaim
    on), the same victims and tokens."""
    runs = score_servers[0]
    pairs = [
        (("h2o", "on"), (SPEC, "off")),
        (("tova", "on"), ("tova", "off")),
        (("scissorhands", "on"), ("scissorhands", "off")),
    ]
    for on, off in pairs:
        (ids_on, st_on, log_on), (ids_off, st_off, log_off) = runs[on], runs[off]
        assert "'disable_overlap_schedule': False" in log_on and "without the overlap scheduler" not in log_on, on
        assert "'disable_overlap_schedule': True" in log_off, off
        assert st_on["tokens_evicted"] == st_off["tokens_evicted"] > 0, on
        assert st_on["digest_victims"] == st_off["digest_victims"], on
        assert ids_on == ids_off, on
        assert st_on["steps_scored"] > 0 and st_off["steps_scored"] > 0, on


@pytest.mark.server
def test_server_serves_a_policy_of_ones_own(score_servers):
    """The same load under built-in h2o (vToken) and under own_policy's HeavyHitters (Naive-Evict; imported in the
    launcher and in the scheduler from PYTHONPATH): evictions, identical victims and tokens, nothing leaked."""
    runs = score_servers[0]
    (ids_builtin, st_builtin, _), (ids_own, st_own, log_own) = runs["h2o", "on"], runs[SPEC, "off"]
    assert st_own["tokens_evicted"] == st_builtin["tokens_evicted"] > 0
    assert st_own["digest_victims"] == st_builtin["digest_victims"]
    assert ids_own == ids_builtin
    assert st_builtin["pages_reclaimed"] > 0 and st_own["position_mismatches"] == 0
    assert f"scheduler tp_rank=0: vToken on: policy={SPEC} " in log_own  # the scheduler built it
    assert "Traceback" not in log_own and "memory leak" not in log_own


@pytest.mark.server
def test_a_requests_output_does_not_depend_on_who_reads_its_prefix(score_servers):
    """Every score policy (h2o, tova, scissorhands, snapkv; vToken and Naive-Evict) decides from each request's
    own attention, a shared prefix's tokens included: a request's greedy output alone (cold), among five others
    reading its system prompt from the radix tree at the same time, and alone again (warm) is the same; a nested
    fork program gives the same tokens on a warm tree as on its first run; and vToken gives Naive-Evict's tokens
    on this shared load."""
    runs, iso = score_servers[0], score_servers[3]
    for config, r in iso.items():
        assert r["alone"] == r["together"][0] == r["again"], config
        assert r["forks"][0] == r["forks"][1], config
        assert r["cached"][0] == 0 and min(r["cached"][2:]) >= len(SYSTEM), (config, r["cached"])  # the tree's
        st = r["state"]
        assert st["tokens_evicted"] > runs[config][1]["tokens_evicted"], config  # the shared load evicted
        assert st["live_tokens"] == 0 and st["state_shared_entries"] == 0 and st["position_mismatches"] == 0, config
        assert "Traceback" not in r["log"] and "memory leak" not in r["log"], config
    for naive, vtoken in [((p, "off"), (p, "on")) for p in SCORE_POLICIES] + [((SPEC, "off"), ("h2o", "on"))]:
        for key in ("alone", "together", "forks"):
            assert iso[naive][key] == iso[vtoken][key], (vtoken, key)
    assert sum(r["state"].get("cow_copies", 0) for r in iso.values()) > 0  # shared pages went by copy-on-write


def test_a_forward_to_score_without_queries_is_counted_and_said(caplog):
    """A forward that was to be scored but whose scored layers kept no query (a CUDA graph captured without their
    hook) is not scored silently: one error line, and every such forward counted (decode forwards: counted on the
    device and compared when the metrics are read; prefill windows: when their results are processed)."""
    import logging
    from types import SimpleNamespace

    from vtoken_sglang.core.pages import PagePool
    from vtoken_sglang.core.token_table import TokenTable
    from vtoken_sglang.integration.parts.request_rows import RequestRows
    from vtoken_sglang.integration.parts.score_link import ScoreLink
    from vtoken_sglang.integration.parts.tp_group import TpGroup
    from vtoken_sglang.policies import PolicyConfig, make_policy
    from vtoken_sglang.scoring import ScoreCollector

    table = TokenTable(4, 64, PagePool(8, 16))
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="a"), SimpleNamespace(rid="b")])
    for policy, counter in (("tova", "steps_unscored"), ("snapkv", "prefills_unscored")):
        prefill = policy in AT_PREFILL
        scorer = ScoreCollector(2, decode=not prefill, prefill_window=8 if prefill else 0)
        link = ScoreLink(
            scorer, make_policy(policy, PolicyConfig(budget=32)), RequestRows(table, table.pages), None, TpGroup()
        )
        caplog.clear()
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                if prefill:
                    scorer.begin_forward(False, [20, 12], [0, 0], key=("a", "b"))
                    link.observe_prefill(batch)
                else:
                    scorer.begin_forward(True)
            assert link.metrics()[counter] == 3 and link.metrics()["prefills_scored"] == 0, policy
        assert [r.levelname for r in caplog.records] == ["ERROR"] and counter in caplog.text, policy
