"""Block manager invariants under random allocate / compute / grow / free sequences."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.protocol.block_hash import compute_block_hashes
from splitserve.protocol.sampling_params import SamplingParams
from tests.generate_requests import generate_request

BLOCK = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, len(PREFIXES) - 1), st.integers(1, 10), st.booleans()),
        st.tuples(st.just("compute"), st.integers(0, 7)),
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("free"), st.integers(0, 7)),
    ),
    max_size=40,
)


def make_request(index: int, tokens: list[int], salt: str | None) -> Request:
    return Request(
        generate_request(f"r{index}", tokens, SamplingParams(), cache_salt=salt),
        eos_token_ids=frozenset(),
        block_size=BLOCK,
    )


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(3, 16), caching=st.booleans())
def test_random_operations_keep_the_accounting_consistent(ops, num_blocks, caching):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    live: list[Request] = []
    created = 0
    for op in ops:
        if op[0] == "add":
            _, prefix, extra, salted = op
            tokens = PREFIXES[prefix] + list(range(100, 100 + extra))
            request = make_request(created, tokens, "tenant" if salted else None)
            created += 1
            hits = bm.get_computed_blocks(request)
            # a hit never covers the last token, and every hit holds this request's prefix
            assert len(hits) * BLOCK <= request.num_tokens - 1
            for index, block_id in enumerate(hits):
                assert bm.block_hashes[block_id] == request.block_hashes[index]
            if not caching:
                assert hits == []
            if bm.allocate_slots(request, request.num_tokens, hits):
                request.num_computed_tokens = len(hits) * BLOCK
                live.append(request)
            else:
                assert request.block_ids == []
        elif live:
            request = live[op[1] % len(live)]
            if op[0] == "compute":
                request.num_computed_tokens = request.num_tokens
                bm.cache_full_blocks(request)
            elif op[0] == "grow":
                before = list(request.block_ids)
                if bm.allocate_slots(request, request.num_tokens + op[2]):
                    for token in range(op[2]):
                        request.append_token(200 + token)
                else:
                    assert request.block_ids == before
            else:
                bm.free_blocks(request)
                live.remove(request)
        bm.check_integrity(live)
        assert bm.num_free_blocks == num_blocks - len({b for r in live for b in r.block_ids})
    for request in live:
        bm.free_blocks(request)
    bm.check_integrity([])
    assert bm.num_free_blocks == num_blocks


def test_salt_separates_tenants_and_hashes_chain():
    tokens = list(range(12))
    plain = compute_block_hashes(tokens, BLOCK)
    salted = compute_block_hashes(tokens, BLOCK, cache_salt="a")
    assert len(plain) == 3 and all(a != b for a, b in zip(plain, salted, strict=True))
    changed = compute_block_hashes([99, *tokens[1:]], BLOCK)
    assert all(a != b for a, b in zip(plain, changed, strict=True))  # chained: the change propagates
    assert compute_block_hashes(tokens[:11], BLOCK) == plain[:2]  # only full blocks


def test_freed_prefix_is_revived_and_lru_evicts_oldest():
    bm = BlockManager(4, BLOCK)
    first = make_request(0, list(range(9)), None)
    assert bm.allocate_slots(first, 9)
    first.num_computed_tokens = 9
    bm.cache_full_blocks(first)
    bm.free_blocks(first)
    again = make_request(1, list(range(9)), None)
    hits = bm.get_computed_blocks(again)
    assert hits == first_blocks_of(bm, again)
    assert len(hits) == 2
    assert bm.allocate_slots(again, 9, hits)
    bm.check_integrity([again])
    bm.free_blocks(again)
    # a request needing every block evicts the cached ones
    big = make_request(2, [50] * 16, None)
    assert bm.allocate_slots(big, 16)
    assert bm.cached == {}
    bm.check_integrity([big])


def first_blocks_of(bm: BlockManager, request: Request) -> list[int]:
    return [bm.cached[h] for h in request.block_hashes[:2]]
