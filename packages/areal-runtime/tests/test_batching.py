from areal_runtime.batching import take_batch


def test_everything_that_fits_goes_in_one_message():
    assert take_batch([b"a", b"bb", b"ccc"], len, limit=10) == ([b"a", b"bb", b"ccc"], [])


def test_a_full_message_leaves_the_rest_queued_in_order():
    queue = [b"x" * 4, b"y" * 4, b"z" * 4, b"w"]
    batch, rest = take_batch(queue, len, limit=8)
    assert batch == [b"x" * 4, b"y" * 4] and rest == [b"z" * 4, b"w"]


def test_an_item_over_the_limit_still_goes_alone():
    big = b"x" * 100
    assert take_batch([big, b"a"], len, limit=10) == ([big], [b"a"])
    assert take_batch([], len, limit=10) == ([], [])
