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


def test_floor_bound_on_hand_worked_numbers():
    # 1e6 layer weights x 500 prefilled tokens x 2 FLOPs = 1e9 FLOPs at 1e10 FLOP/s: 0.1 s; 40 decode steps
    # at 5 ms: 0.2 s; a rollout that took 0.6 s is at most 0.6 / 0.3 = 2x from the floor
    out = bench.floor_bound(10 ** 6, 500, 40, 1e10, 0.005, 0.6)
    assert abs(out["prefill_floor_s"] - 0.1) < 1e-12 and abs(out["decode_floor_s"] - 0.2) < 1e-12
    assert abs(out["floor_speedup"] - 2.0) < 1e-9


def test_step_matrices_are_every_layer_weight_and_the_head_once():
    import jax
    import numpy as np

    from marl_jax.models import decoder

    cfg = decoder.ModelConfig(family="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=3,
                              num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4,
                              tie_word_embeddings=True, qkv_bias=False, qk_norm=False, max_position_embeddings=32,
                              bos_token_id=1, eos_token_id=2)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    mats = bench.step_matrices(params)
    assert len(mats) == 7 * cfg.num_layers + 1  # q, k, v, o, gate, up, down per layer; the head
    layer_weights = sum(w.size for w in jax.tree.leaves(params["layers"]) if w.ndim == 3)
    assert sum(m.size for m in mats[:-1]) == layer_weights
    np.testing.assert_array_equal(mats[-1], params["embed"].T)
    np.testing.assert_array_equal(mats[0], params["layers"]["w_down"][0])  # sorted names, layer 0 first
