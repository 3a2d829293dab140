"""benchmarks/rollout.py --headroom: the prompt-lookup step count, on hand-worked rows."""
import importlib.util
import pathlib

_spec = importlib.util.spec_from_file_location(
    "bench_rollout", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "rollout.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_lookup_draft_prefers_the_longest_recent_match():
    # last token 2 occurs at index 1 -> the draft is what followed it
    assert bench.lookup_draft([1, 2, 3, 4, 2], 4) == [3, 4, 2]
    # the 2-token tail [4, 2] occurs at index 0; the more recent 1-token match (2 at index 3) loses to it
    assert bench.lookup_draft([4, 2, 7, 2, 9, 4, 2], 2) == [7, 2]
    assert bench.lookup_draft([1, 2, 3], 4) == []


def test_lookup_steps_counts_accepted_drafts_plus_the_rows_own_token():
    # draft [3, 4, 2]: 3 and 4 accepted, 2 rejected; the row's own token 9 ends the step: 1 step, 3 tokens
    assert bench.lookup_steps([1, 2, 3, 4, 2], [3, 4, 9], 4) == 1
    # one-token drafts: [3] accepted with 4; then the draft [2] (after 2, 3, 4) loses to 9: 2 steps
    assert bench.lookup_steps([1, 2, 3, 4, 2], [3, 4, 9], 1) == 2
    # nothing to look up: one token per step
    assert bench.lookup_steps([1], [5, 6, 7], 4) == 3
