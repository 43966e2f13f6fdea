"""fake_repeat: the factor nests, comes back after an error, refuses a count that is not a positive int; the runs
of a fake loop cover every start of the real one."""

import pytest

from lightning_memkit.measure.fake_repeat import alike_runs, repeat_factor, stands_for


def test_the_factor_comes_back_after_an_error():
    with pytest.raises(KeyError), stands_for(4):
        assert repeat_factor() == 4
        raise KeyError("x")
    assert repeat_factor() == 1


@pytest.mark.parametrize("count", [0, -2, 1.5, True and 2.0])
def test_a_count_that_is_not_a_positive_int(count):
    with pytest.raises(ValueError, match=r"stands_for\(count=.*\): a positive int"):
        with stands_for(count):
            pass
    assert repeat_factor() == 1


@pytest.mark.parametrize(("stop", "step"), [(1, 1), (7, 7), (8, 7), (1000, 16), (128256, 17), (5, 9)])
def test_the_fake_runs_count_every_iteration_and_keep_every_width(stop, step):
    real = alike_runs(stop, step, fake=False)
    fake = alike_runs(stop, step, fake=True)
    assert sum(c for _, c in fake) == len(real) == len(range(0, stop, step))
    widths = {min(s + step, stop) - s for s, _ in real}
    assert {min(s + step, stop) - s for s, _ in fake} == widths
    assert len(fake) <= 2


def test_allocations_count_apart_from_the_ops_and_nest():
    from lightning_memkit.measure.fake_repeat import allocation_factor

    with stands_for(3, allocations=0):
        assert (repeat_factor(), allocation_factor()) == (3, 0)
        with stands_for(2):
            assert (repeat_factor(), allocation_factor()) == (6, 0)
    with stands_for(1, allocations=0):
        assert (repeat_factor(), allocation_factor()) == (1, 0)
    with stands_for(4):
        assert (repeat_factor(), allocation_factor()) == (4, 4)
    assert (repeat_factor(), allocation_factor()) == (1, 1)
    with pytest.raises(ValueError, match=r"stands_for\(allocations=-1\): an int >= 0"):
        stands_for(2, allocations=-1)
