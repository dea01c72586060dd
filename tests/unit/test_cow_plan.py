"""The copy-on-write decision (``core.cow.plan_cow``): copy only when the projected page count drops."""

from vtoken_sglang.core.cow import Holder, PrefixNode, plan_cow

P = 16


def test_single_holder_copies_when_most_of_its_prefix_is_dead():
    nodes = {1: PrefixNode(lock_ref=1, pages=8)}
    plan = plan_cow([Holder(7, (1,), (20,))], nodes, P)
    assert [(d.key, d.cut, d.tokens, d.pages) for d in plan.decisions] == [(7, 0, 20, 2)]
    assert plan.pages_released == 8 and plan.gain == 6


def test_no_copy_when_it_would_not_free_pages():
    nodes = {1: PrefixNode(lock_ref=1, pages=2)}
    assert plan_cow([Holder(7, (1,), (20,))], nodes, P).decisions == ()  # 2 pages for 2: no gain


def test_shared_prefix_needs_every_holder_and_a_gain():
    nodes = {1: PrefixNode(lock_ref=2, pages=10)}
    both = [Holder(1, (1,), (30,)), Holder(2, (1,), (40,))]
    plan = plan_cow(both, nodes, P)
    assert sorted(d.key for d in plan.decisions) == [1, 2] and plan.gain == 10 - 2 - 3
    # several live holders: 4 x 3 pages of copies for 10 shared pages does not pay
    nodes = {1: PrefixNode(lock_ref=4, pages=10)}
    assert plan_cow([Holder(k, (1,), (40,)) for k in range(4)], nodes, P).decisions == ()


def test_a_holder_outside_the_candidates_keeps_the_node():
    nodes = {1: PrefixNode(lock_ref=2, pages=10)}  # the second lock is a request that is not a candidate
    assert plan_cow([Holder(1, (1,), (0,))], nodes, P).decisions == ()


def test_private_suffix_alone_when_the_shared_part_does_not_pay():
    # node 1 (system prompt) shared by 3 holders with much live; each owns node 10+k (its own question)
    nodes = {1: PrefixNode(3, 4), **{10 + k: PrefixNode(1, 3) for k in range(3)}}
    holders = [Holder(k, (1, 10 + k), (80, 5)) for k in range(3)]  # all three: 15 pages for 13
    plan = plan_cow(holders, nodes, P)
    assert sorted((d.key, d.cut, d.tokens) for d in plan.decisions) == [(0, 1, 5), (1, 1, 5), (2, 1, 5)]
    assert plan.pages_released == 9 and plan.pages_copied == 3


def test_naive_evict_only_releases_nodes_with_nothing_live():
    nodes = {1: PrefixNode(1, 4), 2: PrefixNode(1, 4)}
    assert plan_cow([Holder(1, (1,), (3,))], nodes, P, allow_copies=False).decisions == ()
    plan = plan_cow([Holder(2, (2,), (0,))], nodes, P, allow_copies=False)
    assert [(d.key, d.tokens) for d in plan.decisions] == [(2, 0)] and plan.pages_released == 4


def test_groups_are_independent_and_deterministic():
    nodes = {1: PrefixNode(2, 6), 2: PrefixNode(2, 6)}
    holders = [Holder(1, (1,), (3,)), Holder(2, (1,), (3,)), Holder(3, (2,), (90,)), Holder(4, (2,), (90,))]
    plan = plan_cow(holders, nodes, P)
    assert sorted(d.key for d in plan.decisions) == [1, 2]  # group {3, 4} would need 12 pages for 6
    assert set(plan.decisions) == set(plan_cow(list(reversed(holders)), nodes, P).decisions)


def test_groups_release_disjoint_nodes_and_each_gains():
    """The integration carries out a plan's groups one by one, as pages allow: each group must pay on its own and
    a shared node must be released by its group only (so any subset of groups is a valid, gainful plan)."""
    nodes = {1: PrefixNode(2, 8), 2: PrefixNode(1, 5), **{10 + k: PrefixNode(1, 3) for k in range(3)}}
    holders = [Holder(0, (1,), (3,)), Holder(1, (1,), (2,)), Holder(2, (2,), (20,))]
    holders += [Holder(3 + k, (10 + k,), (4,)) for k in range(3)]
    plan = plan_cow(holders, nodes, P)
    assert [sorted(d.key for d in g.decisions) for g in plan.groups] == [[0, 1], [2], [3], [4], [5]]
    assert [(g.pages_released, g.pages_copied) for g in plan.groups] == [(8, 2), (5, 2), (3, 1), (3, 1), (3, 1)]
    assert all(g.pages_released > g.pages_copied for g in plan.groups)
    assert plan.pages_released == 22 and plan.pages_copied == 7 and len(plan.decisions) == 6


def test_a_group_too_large_for_the_room_copies_its_own_parts_first():
    """Four holders share node 1 (a page); each owns a node of 24 pages with 12 pages live. Together: 48 pages of
    copies for 97. With room for 20, each copies its own node alone (12 for 24), every copy growing the room by its
    gain, and the shared page waits for a later check."""
    nodes = {1: PrefixNode(4, 1), **{10 + k: PrefixNode(1, 24) for k in range(4)}}
    holders = [Holder(k, (1, 10 + k), (12 * P + 1, 12 * P)) for k in range(4)]
    whole = plan_cow(holders, nodes, P)
    assert len(whole.groups) == 1 and whole.pages_copied == 52 and not whole.deferred
    plan = plan_cow(holders, nodes, P, room=20)
    assert [(d.key, d.cut, d.pages) for d in plan.decisions] == [(k, 1, 12) for k in range(4)] and plan.deferred
    assert plan.pages_released == 96 and plan.pages_copied == 48
    assert plan.waiting == {0, 1, 2, 3} and not whole.waiting  # the shared page waits for all four
    tight = plan_cow(holders, nodes, P, room=11)
    assert tight.decisions == () and tight.deferred and tight.waiting == {0, 1, 2, 3}  # not even a member's part


def test_each_group_taken_adds_its_gain_to_the_room():
    nodes = {1: PrefixNode(1, 10), 2: PrefixNode(1, 10)}
    holders = [Holder(1, (1,), (5 * P,)), Holder(2, (2,), (5 * P,))]
    plan = plan_cow(holders, nodes, P, room=5)  # the first frees 10 for 5: room 10 for the second
    assert [d.key for d in plan.decisions] == [1, 2] and not plan.deferred and not plan.waiting
    short = plan_cow(holders, nodes, P, room=4)  # neither fits: both copies wait, and admission holds their room
    assert short.decisions == () and short.deferred and short.waiting == {1, 2}
