"""A pipeline step's micro-batches: contiguous runs of the step's tokens in its order, a chunk
that straddles a boundary split into two chunks of the same request."""
from common.worker.micro_batches import MIN_TOKENS, MicroBatch, split

A, B = [1, 2, 3], [7, 8]


def test_a_long_prompt_splits_into_chunks_that_follow_each_other():
    assert split([], [(0, 100, A)], 2) == [MicroBatch(0, 50, [], [(0, 50, A)]),
                                          MicroBatch(50, 100, [], [(50, 50, A)])]
    # a prefix already cached: positions go on from it
    assert split([], [(32, 30, A)], 3) == [MicroBatch(0, 10, [], [(32, 10, A)]),
                                          MicroBatch(10, 20, [], [(42, 10, A)]),
                                          MicroBatch(20, 30, [], [(52, 10, A)])]


def test_decodes_come_first_and_chunks_fill_the_rest():
    decodes = [(i + 5, B) for i in range(12)]
    got = split(decodes, [(0, 20, A), (4, 6, B)], 2)
    assert got == [MicroBatch(0, 19, decodes[:12], [(0, 7, A)]),
                   MicroBatch(19, 38, [], [(7, 13, A), (4, 6, B)])]
    for a, b in zip(got, got[1:]):
        assert a.end == b.start
    assert sum(len(m.decodes) + sum(n for _, n, _ in m.chunks) for m in got) == 38


def test_a_small_step_stays_whole():
    assert split([(3, A)], [(0, MIN_TOKENS, B)], 4) == [
        MicroBatch(0, MIN_TOKENS + 1, [(3, A)], [(0, MIN_TOKENS, B)])]
    assert len(split([], [(0, 2 * MIN_TOKENS, A)], 4)) == 2
