"""SGLang's streaming sessions under vToken (``--enable-streaming-session``) on the real SmolLM2-135M-Instruct,
float32, real SGLang on CPU, relocation with late fences and the integrity check on.

A 20-turn conversation (user turns cut from ShareGPT, ``tools.chat_turns``) through the session API under
streaming and h2o at a budget of 96, well under the conversation's ~1K tokens (on streaming's server, longer than
the pool of 512: bounded by the context at the door, not by the pool): every turn's tokens equal
transformers fed the whole conversation so far with the positions the victim log names hidden from later queries;
each turn prefills only its own tokens (the session's logical length is its cached prefix); the session holds its
budget + slack at every turn's end and at most that + a turn in a prefill; the idle checks (vToken's and SGLang's
strict leak check, parked rows counted) hold with the session open, and closing it releases every page.

Eight concurrent sessions of four turns on h2o, vToken and Naive-Evict: one turn aborted mid-decode (upstream's
rule: the session's next turn prefills its last finished history again; the victim log's reset line), one session
closed after its second turn; then a session that times out after two turns (its next turn refused); the others'
tokens equal Naive-Evict's and the reference, nothing leaked.

A turn that takes its session past the context gets one error line; the session's next turn still equals the
reference."""

from __future__ import annotations

import threading
import time
import urllib.error

import pytest
from conftest import STRICT, on_servers
from masked_reference import load, masked_greedy_turns

from vtoken_sglang.integration.observe import victim_log
from vtoken_sglang.tools import launcher
from vtoken_sglang.tools.chat_turns import conversations
from vtoken_sglang.tools.session_client import Session

pytestmark = pytest.mark.server

BUDGET, SINKS, RECENT, SLACK, POOL, CONTEXT = 96, 4, 16, 16, 2048, 2048
LONG_POOL = 512  # the 20-turn conversation's server: a pool smaller than the conversation
TURNS, TURN_TOKENS, NEW_TOKENS = 20, 40, 8
SESSIONS, SESSION_TURNS, ABORTED, CLOSED = 8, 4, (3, 2), 5  # (session, turn) aborted; session closed after turn 2
TIMEOUT_S = 3  # a ninth session's idle timeout


def flags(policy: str, reclaim: bool = True, pool: int = POOL) -> list[str]:
    return launcher.default_server_args(pool) + [
        "--enable-vtoken",
        "--vtoken-policy",
        policy,
        "--vtoken-budget",
        str(BUDGET),
        "--vtoken-sinks",
        str(SINKS),
        "--vtoken-recent",
        str(RECENT),
        "--vtoken-reclaim",
        "on" if reclaim else "off",
        "--enable-streaming-session",
        "--context-length",
        str(CONTEXT),
    ]


def vtoken_state(server) -> dict:
    return server.get("/get_server_info")["internal_states"][0]["vtoken"]


@pytest.fixture(scope="module")
def dialogues(smollm2) -> list[list[list[int]]]:
    """The 20-turn conversation, then the eight 4-turn ones."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    return conversations(tok, 1, TURNS, TURN_TOKENS) + conversations(tok, SESSIONS, SESSION_TURNS, 24, start=500)


def long_conversation(server, turns: list[list[int]], past_context: list[int] | None) -> dict:
    """The 20 turns through one session, the server's state after each; then (``past_context``) a turn past the
    context and one more turn."""
    s = Session(server, "long")
    states = []
    for ids in turns:
        s.turn(ids, NEW_TOKENS)
        states.append(vtoken_state(server))
    out = {"session": s, "states": states}
    if past_context is not None:
        try:
            out["refused"] = server.post("/generate", {"input_ids": past_context, "session_params": {"id": s.id}})
        except urllib.error.HTTPError as err:
            out["refused"] = err.read().decode()
        s.turn(turns[1], NEW_TOKENS)
        out["after_refusal"] = vtoken_state(server)
    s.close()
    out["closed"] = _idle(server)
    return out


def concurrent_sessions(server, dialogues: list[list[list[int]]]) -> dict:
    """Eight sessions, each turn after its last, all at once; one turn aborted in its decode, one session closed
    after its second turn."""
    sessions = [Session(server, f"s{i}") for i in range(len(dialogues))]

    def run(i: int) -> None:
        for k, ids in enumerate(dialogues[i]):
            if (i, k) == ABORTED:
                threading.Timer(3.0, server.post, ("/abort_request", {"rid": f"abort-{i}"})).start()
                sessions[i].turn(ids, 400, rid=f"abort-{i}")
            else:
                sessions[i].turn(ids, NEW_TOKENS)
            if i == CLOSED and k == 1:
                sessions[i].close()
                return

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # a session that times out (``timeout``: idle seconds) after two turns: released, its next turn refused
    timed = Session(server, "timed", timeout=TIMEOUT_S)
    for ids in dialogues[0][:2]:
        timed.turn(ids, NEW_TOKENS)
    time.sleep(TIMEOUT_S + 3)
    try:
        after_timeout = timed.turn(dialogues[0][2], NEW_TOKENS)
    except urllib.error.HTTPError as err:
        after_timeout = err.code
    for i, s in enumerate(sessions):
        if i != CLOSED:
            s.close()
    return {"sessions": sessions, "timed": timed, "after_timeout": after_timeout, "closed": _idle(server)}


def _idle(server, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = vtoken_state(server)
        if state["live_tokens"] == 0 or time.monotonic() > deadline:
            return state
        time.sleep(0.5)


@pytest.fixture(scope="module")
def runs(smollm2, dialogues, tmp_path_factory):
    logs = tmp_path_factory.mktemp("victims")
    servers = {
        name: launcher.SglangServer(
            smollm2,
            flags(policy, reclaim, pool),
            env={**STRICT, "VTOKEN_SGLANG_VICTIM_LOG": str(logs / f"{name}.jsonl")},
        )
        for name, policy, reclaim, pool in (
            ("streaming", "streaming", True, LONG_POOL),
            ("h2o", "h2o", True, POOL),
            ("naive", "h2o", False, POOL),
        )
    }
    long_turns, short = dialogues[0], dialogues[1:]

    def load_one(name, server):
        out = {}
        if name != "naive":
            past = long_turns[0] * (CONTEXT // len(long_turns[0]) + 1) if name == "streaming" else None
            out["long"] = long_conversation(server, long_turns, past)
        if name != "streaming":
            out["concurrent"] = concurrent_sessions(server, short)
        out["events"] = victim_log.read(logs / f"{name}.jsonl", by="session")
        out["log"] = server.log_text()
        return out

    return on_servers(servers, load_one)


@pytest.fixture(scope="module")
def reference(smollm2):
    return load(smollm2, attention="sdpa")


def assert_clean(r: dict, state: dict) -> None:
    log = r["log"]
    assert "integrity check failed" not in log and "leak" not in log.lower(), log[-3000:]
    assert state["position_mismatches"] == 0 and state["integrity_checks"] > 0, state
    assert state["live_tokens"] == 0 and state["allocated_pages"] == 0, state


def assert_equal_reference(reference, session: Session, events: list) -> None:
    wanted = masked_greedy_turns(reference, session.turns, events)
    for k, ((prompt, output), want) in enumerate(zip(session.turns, wanted)):
        assert prompt == session.turns[-1][0][: len(prompt)]  # every turn's conversation is the last one's prefix
        assert output == want, f"{session.name} turn {k}: server {output} vs transformers {want}"


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_a_20_turn_conversation_equals_transformers_masked_and_holds_its_budget(runs, reference, policy):
    r = runs[policy]
    long = r["long"]
    s, states = long["session"], long["states"]
    assert_clean(r, long["closed"])
    events = r["events"][s.id]
    assert sum(len(e) for _, e in events) > 500  # most of the conversation was evicted
    assert len(s.history) > 6 * BUDGET
    if policy == "streaming":  # a conversation longer than its server's pool: SGLang's door would refuse it
        assert len(s.history) > LONG_POOL
    assert_equal_reference(reference, s, events)
    # each turn prefilled only its own tokens: its cached prefix is the session's logical length (its last answer's
    # last token had no KV yet)
    assert s.cached[1:] == [len(prev) + len(out) - 1 for prev, out in s.turns[:-1]]
    # the session holds its budget (+ slack) after every turn, whatever the conversation's length
    held = [st["live_tokens"] for st in states]
    assert max(held[2:]) <= BUDGET + SLACK and min(held[2:]) >= BUDGET, held
    turn = max(len(p) - len(pp) - len(po) for (pp, po), (p, _) in zip(s.turns, s.turns[1:]))
    assert states[-1]["peak_extend_kv"] <= BUDGET + SLACK + turn + 1, states[-1]
    assert max(st["allocated_pages"] for st in states[2:]) <= (BUDGET + SLACK) // 16 + 3


def test_a_turn_past_the_context_gets_one_error_line_and_the_session_goes_on(runs, reference):
    r = runs["streaming"]
    long = r["long"]
    text = str(long["refused"])
    assert "context length" in text or "maximum allowed length" in text or "exceeds" in text, text
    s = long["session"]
    assert len(s.turns) == TURNS + 1  # the turn after the refusal was served, on the same session
    assert_equal_reference(reference, s, r["events"][s.id])


def test_concurrent_sessions_with_an_abort_and_an_early_close_equal_naive_evict_and_leak_nothing(runs, reference):
    vt, naive = runs["h2o"], runs["naive"]
    for r in (vt, naive):
        assert_clean(r, r["concurrent"]["closed"])
    got, want = vt["concurrent"]["sessions"], naive["concurrent"]["sessions"]
    for i, (a, b) in enumerate(zip(got, want)):
        assert [o for _, o in a.turns] == [o for _, o in b.turns], f"session {i}"
        assert len(a.turns) == (2 if i == CLOSED else SESSION_TURNS - (i == ABORTED[0]))
        assert_equal_reference(reference, a, vt["events"].get(a.id, []))
    # the session that timed out: its two turns equal Naive-Evict's and the reference, its third refused
    timed = vt["concurrent"]["timed"]
    assert len(timed.turns) == 2 and vt["concurrent"]["after_timeout"] in (None, 400)  # aborted, or 400 at once
    assert [o for _, o in timed.turns] == [o for _, o in naive["concurrent"]["timed"].turns]
    assert_equal_reference(reference, timed, vt["events"].get(timed.id, []))
    # the turn after the abort prefilled the whole finished history again (upstream's rule)
    aborted = got[ABORTED[0]]
    before = aborted.turns[ABORTED[1] - 1]
    assert aborted.cached[ABORTED[1]] < len(before[0]) + len(before[1]) - 1
