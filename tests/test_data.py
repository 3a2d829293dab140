"""Task batching: determinism, epoch coverage, reshuffling, and checkpointable iterator state."""
from __future__ import annotations

import itertools
import json

import pytest

from marl_jax.tasks.base import Task
from marl_jax.tasks.data import split_tasks, task_batches

TASKS = [Task(task_id=f"t{i}", kind="math", question=f"q{i}", answer=str(i)) for i in range(23)]


def _ids(batches) -> list[list[str]]:
    return [[t.task_id for t in b] for b in batches]


def _take(it, k: int) -> list[list[str]]:
    return _ids(itertools.islice(it, k))


def test_batches_are_lists_of_tasks_of_batch_size():
    batch = next(task_batches(TASKS, batch_size=5, seed=0))
    assert isinstance(batch, list) and len(batch) == 5
    assert all(isinstance(t, Task) for t in batch)


def test_deterministic_for_a_seed_and_seeds_differ():
    a = _take(task_batches(TASKS, batch_size=4, seed=7), 20)
    b = _take(task_batches(TASKS, batch_size=4, seed=7), 20)
    c = _take(task_batches(TASKS, batch_size=4, seed=8), 20)
    assert a == b
    assert a != c


@pytest.mark.parametrize("batch_size", [1, 4, 23])
def test_each_epoch_is_a_fresh_permutation(batch_size):
    n, epochs = len(TASKS), 4
    steps = -(-n * epochs // batch_size)  # enough batches to cover the epochs
    flat = [i for b in _take(task_batches(TASKS, batch_size=batch_size, seed=3), steps) for i in b]
    all_ids = sorted(t.task_id for t in TASKS)
    orders = [flat[e * n : (e + 1) * n] for e in range(epochs)]
    for order in orders:
        assert sorted(order) == all_ids  # every task exactly once per epoch
    assert len({tuple(o) for o in orders}) == epochs  # a different order every epoch
    assert orders[0] != [t.task_id for t in TASKS]  # and actually shuffled


def test_no_shuffle_and_single_pass():
    batches = _ids(task_batches(TASKS, batch_size=10, seed=0, shuffle=False, repeat=False))
    assert batches == [[f"t{i}" for i in range(k, min(k + 10, 23))] for k in (0, 10, 20)]
    dropped = _ids(task_batches(TASKS, batch_size=10, seed=0, repeat=False, drop_remainder=True))
    assert [len(b) for b in dropped] == [10, 10]
    one_pass = [i for b in _ids(task_batches(TASKS, batch_size=10, seed=0, repeat=False)) for i in b]
    assert sorted(one_pass) == sorted(t.task_id for t in TASKS)


@pytest.mark.parametrize("json_round_trip", [False, True])
def test_restore_mid_stream_reproduces_following_batches(json_round_trip):
    it = task_batches(TASKS, batch_size=4, seed=11)
    _take(it, 9)  # part-way through the second epoch
    state = it.get_state()
    assert all(type(v) is int for v in state.values())
    if json_round_trip:
        state = json.loads(json.dumps(state))
    expected = _take(it, 15)

    # A brand-new iterator (as after a restart) continues exactly where the saved one was.
    fresh = task_batches(TASKS, batch_size=4, seed=11)
    fresh.set_state(state)
    assert _take(fresh, 15) == expected
    # So does the same iterator rewound after it has moved on.
    it.set_state(state)
    assert _take(it, 15) == expected
    # And the continuation is the tail of an uninterrupted run.
    assert _take(task_batches(TASKS, batch_size=4, seed=11), 24)[9:] == expected


def test_restore_rejects_a_differently_configured_pipeline():
    it = task_batches(TASKS, batch_size=4, seed=11)
    next(it)
    state = it.get_state()
    for other in (
        task_batches(TASKS, batch_size=5, seed=11),
        task_batches(TASKS, batch_size=4, seed=12),
        task_batches(TASKS[::-1], batch_size=4, seed=11),
    ):
        with pytest.raises(ValueError, match="differently configured"):
            other.set_state(state)
    with pytest.raises(ValueError, match="next_index"):
        it.set_state({"batch_size": 4})


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one task"):
        task_batches([], batch_size=2, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        task_batches(TASKS, batch_size=0, seed=0)


def test_split_tasks():
    train, val = split_tasks(TASKS, 0.2, seed=42)
    assert len(val) == round(23 * 0.2) and len(train) + len(val) == 23
    assert {t.task_id for t in train}.isdisjoint(t.task_id for t in val)
    assert sorted(t.task_id for t in train + val) == sorted(t.task_id for t in TASKS)
    order = [t.task_id for t in TASKS]
    assert [t.task_id for t in train] == [i for i in order if i in {t.task_id for t in train}]  # input order kept
    assert split_tasks(TASKS, 0.2, seed=42) == (train, val)
    assert split_tasks(TASKS, 0.2, seed=43)[1] != val
    assert split_tasks(TASKS, 0.0, seed=0) == (list(TASKS), [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_tasks(TASKS, 1.0, seed=0)
