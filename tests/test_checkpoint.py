"""Checkpointer: exact round trips, keep-last-N plus best, atomicity against killed saves, clear errors."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marl_jax.train.checkpoint import COMMIT_FILE, Checkpointer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(seed: int = 0) -> dict:
    """A training-like state: bf16/f32 params, an adamw state after one update, keys, int scalars."""
    k = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(k, 3)
    params = {
        "lora": {"a": jax.random.normal(k1, (2, 4, 3), jnp.bfloat16),
                 "b": jax.random.normal(k2, (2, 3, 4), jnp.float32)},
        "scale": jnp.asarray(0.5, jnp.float32),
    }
    opt = optax.adamw(1e-2, weight_decay=0.01)
    opt_state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.3, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return {
        "params": params,
        "opt_state": opt_state,
        "rng": jax.random.key_data(k3),  # uint32 key data, as the loop stores it
        "typed_rng": jax.random.key(seed + 100),
        "step": np.int64(17),
        "counter": jnp.asarray(5, jnp.int32),
        "host": np.arange(6, dtype=np.int16).reshape(2, 3),
    }


def _leaves(tree):
    def norm(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
        return ("arr", type(x).__name__, np.array(x))
    return [norm(x) for x in jax.tree.leaves(tree)]


def _assert_exact(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (ka, ta, xa), (kb, tb, xb) in zip(_leaves(a), _leaves(b)):
        assert (ka, ta) == (kb, tb)
        assert xa.dtype == xb.dtype and xa.shape == xb.shape
        assert xa.tobytes() == xb.tobytes()  # bitwise, so NaN payloads and -0.0 count too


META = {"data": {"next_index": 12, "num_tasks": 40, "seed": 3}, "config": {"lr": 2e-5, "roles": ["g", "e"]},
        "val": {"success": 0.4}}


def test_round_trip_exact(tmp_path):
    state = _state()
    before = _leaves(state)
    ck = Checkpointer(tmp_path / "run")
    ck.save(10, state, META, best_metric=0.4)
    ck.wait()
    # save left the given state untouched
    for (k0, t0, x0), (k1, t1, x1) in zip(before, _leaves(state)):
        assert x0.tobytes() == x1.tobytes() and x0.dtype == x1.dtype
    restored, meta = Checkpointer(tmp_path / "run").restore(template=state)
    _assert_exact(restored, state)
    assert meta == META
    assert restored["params"]["lora"]["a"].dtype == jnp.bfloat16
    assert isinstance(restored["step"], np.int64) and int(restored["step"]) == 17
    assert restored["rng"].dtype == np.uint32
    # the restored key draws the same numbers as the original
    np.testing.assert_array_equal(jax.random.uniform(restored["typed_rng"], (3,)),
                                  jax.random.uniform(state["typed_rng"], (3,)))
    np.testing.assert_array_equal(jax.random.uniform(jax.random.wrap_key_data(restored["rng"]), (3,)),
                                  jax.random.uniform(jax.random.wrap_key_data(state["rng"]), (3,)))


def test_restore_from_abstract_template(tmp_path):
    state = {"w": jnp.arange(12, dtype=jnp.bfloat16).reshape(3, 4), "k": jax.random.key_data(jax.random.key(1))}
    ck = Checkpointer(tmp_path)
    ck.save(1, state)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
    restored, meta = ck.restore(1, template=abstract)
    _assert_exact(restored, state)
    assert meta == {}


def test_save_survives_buffer_deletion(tmp_path):
    # A jitted step that donates its input deletes the buffers right after save() returns.
    state = {"w": jnp.linspace(0, 1, 1000, dtype=jnp.float32).reshape(10, 100)}
    expected = np.array(state["w"])
    ck = Checkpointer(tmp_path)
    ck.save(3, state)
    state["w"].delete()
    ck.wait()
    restored, _ = ck.restore(3)
    np.testing.assert_array_equal(np.asarray(restored["w"]), expected)


def test_keep_last_n_plus_best(tmp_path):
    vals = [0.1, 0.5, 0.9, 0.3, None, 0.2, 0.4, None, 0.35]
    steps = [10 * (i + 1) for i in range(len(vals))]
    ck = Checkpointer(tmp_path, keep=3, keep_best=True)
    for s, v in zip(steps, vals):
        ck.save(s, {"x": np.full((2,), s, np.float32)}, {"step": s}, best_metric=v)
    ck.wait()
    scored = [(v, s) for s, v in zip(steps, vals) if v is not None]
    best = max(scored)[1]
    expected = sorted(set(steps[-3:]) | {best})
    assert best == 30
    assert ck.all_steps() == expected
    assert sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit()) == expected
    assert ck.best_step() == best and ck.latest_step() == steps[-1]
    assert ck.best_metric(best) == pytest.approx(0.9)
    # a fresh instance reads the same from disk; the old best still restores
    ck2 = Checkpointer(tmp_path, keep=3)
    assert ck2.best_step() == best and ck2.latest_step() == steps[-1]
    state, meta = ck2.restore(best)
    assert meta == {"step": best} and np.all(np.asarray(state["x"]) == best)
    # a new best later on replaces the old one, which then ages out
    ck2.save(100, {"x": np.zeros(2, np.float32)}, best_metric=0.95)
    ck2.save(110, {"x": np.zeros(2, np.float32)}, best_metric=0.1)
    assert ck2.all_steps() == [90, 100, 110]  # 30 aged out, 100 is both recent and best
    assert ck2.best_step() == 100


def test_keep_without_best(tmp_path):
    ck = Checkpointer(tmp_path, keep=2, keep_best=False)
    for s, v in [(1, 0.9), (2, 0.1), (3, 0.2)]:
        ck.save(s, {"x": np.ones(1)}, best_metric=v)
    assert ck.all_steps() == [2, 3]
    assert ck.best_step() == 3  # best among the kept ones


def test_latest_ignores_leftover_unfinished_dirs(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(5, {"x": np.ones(3)}, best_metric=0.5)
    ck.wait()
    ckdir = tmp_path / "checkpoints"
    # orbax's temporary directory of an interrupted save, and a step directory without a commit marker
    (ckdir / "9.orbax-checkpoint-tmp-1700000000" / "state").mkdir(parents=True)
    (ckdir / "8" / "state").mkdir(parents=True)
    (ckdir / "8" / "state" / "junk").write_text("partial")
    ck2 = Checkpointer(tmp_path)
    assert ck2.latest_step() == 5 and ck2.all_steps() == [5] and ck2.best_step() == 5
    state, _ = ck2.restore()
    np.testing.assert_array_equal(np.asarray(state["x"]), np.ones(3))
    with pytest.raises(FileNotFoundError, match="available steps"):
        ck2.restore(9)
    # and the run continues past them
    ck2.save(10, {"x": np.zeros(3)})
    assert ck2.latest_step() == 10


_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from marl_jax.train.checkpoint import Checkpointer
    workdir, mode = sys.argv[1], sys.argv[2]
    ck = Checkpointer(workdir)
    ck.save(1, {"x": np.full((4,), 1.0, np.float32)}, {"step": 1}, best_metric=0.1)
    ck.wait()
    if mode == "hang_before_commit":
        # Block the commit (marker + rename) of step 2 after all its data is written: the worst moment.
        from orbax.checkpoint._src.path import atomicity
        async def hang(self, *a, **k):
            print("writing-done", flush=True)
            time.sleep(600)
        atomicity.AtomicRenameTemporaryPath.finalize = hang
    big = {"x": np.random.default_rng(0).standard_normal((4, 4_000_000)).astype(np.float32)}
    ck.save(2, big, {"step": 2}, best_metric=0.9)
    print("save-returned", flush=True)
    ck.wait()
    print("committed", flush=True)
    time.sleep(600)
""")


def _run_and_kill(workdir, mode: str, kill_on: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(workdir), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    seen = []
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            line = proc.stdout.readline().strip()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            if line == kill_on:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert kill_on in seen, f"child never reached {kill_on!r}: {seen}"
    return seen


def test_killed_before_commit_is_never_latest(tmp_path):
    _run_and_kill(tmp_path, "hang_before_commit", "writing-done")
    leftovers = os.listdir(tmp_path / "checkpoints")
    assert any(".orbax-checkpoint-tmp" in d for d in leftovers) or "2" in leftovers
    ck = Checkpointer(tmp_path)
    assert ck.latest_step() == 1 and ck.best_step() == 1
    state, meta = ck.restore()
    assert meta == {"step": 1}
    np.testing.assert_array_equal(np.asarray(state["x"]), np.full((4,), 1.0, np.float32))


def test_killed_mid_write(tmp_path):
    # Killed while the background thread writes 64 MB: whatever instant it died, the latest committed
    # step restores completely.
    seen = _run_and_kill(tmp_path, "plain", "save-returned")
    ck = Checkpointer(tmp_path)
    latest = ck.latest_step()
    assert latest in (1, 2)
    if latest == 2:
        assert os.path.isfile(tmp_path / "checkpoints" / "2" / COMMIT_FILE)
    state, meta = ck.restore()
    assert meta == {"step": latest}
    if latest == 1:
        np.testing.assert_array_equal(np.asarray(state["x"]), np.full((4,), 1.0, np.float32))
    else:
        expect = np.random.default_rng(0).standard_normal((4, 4_000_000)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(state["x"]), expect)
    assert "committed" not in seen or latest == 2


def test_restore_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Checkpointer(tmp_path / "missing").restore()
    assert Checkpointer(tmp_path / "missing").latest_step() is None
    assert not (tmp_path / "missing").exists()  # asking does not create anything
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        Checkpointer(tmp_path / "empty").restore()
    ck = Checkpointer(tmp_path / "run")
    ck.save(2, {"x": np.ones(2)})
    with pytest.raises(FileNotFoundError, match=r"available steps: \[2\]"):
        ck.restore(7)


def test_save_input_errors(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(4, {"x": np.ones(2)})
    with pytest.raises(ValueError, match="not after the latest"):
        ck.save(4, {"x": np.ones(2)})
    with pytest.raises(TypeError, match="JSON"):
        ck.save(5, {"x": np.ones(2)}, {"bad": np.ones(2)})
    with pytest.raises(ValueError, match="finite"):
        ck.save(5, {"x": np.ones(2)}, best_metric=float("nan"))
    with pytest.raises(ValueError, match="zero-size"):
        ck.save(5, {"x": np.ones((0, 2))})
    with pytest.raises(TypeError, match="meta"):
        ck.save(5, {"x": "a string"})
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)


def test_read_only_reader_leaves_an_inflight_save_alone(tmp_path):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"x": np.ones(2)})
    ck.wait()
    inflight = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1700000000"
    (inflight / "state").mkdir(parents=True)
    reader = Checkpointer(tmp_path, read_only=True)
    assert reader.latest_step() == 1
    state, _ = reader.restore()
    np.testing.assert_array_equal(np.asarray(state["x"]), np.ones(2))
    assert inflight.exists()
    with pytest.raises(PermissionError, match="read_only"):
        reader.save(3, {"x": np.ones(2)})


def test_sharded_arrays_restore_into_a_new_sharding(tmp_path):
    # 8 fake CPU devices need a fresh process (the device count is fixed at JAX start-up).
    code = textwrap.dedent(f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from marl_jax.train.checkpoint import Checkpointer
        assert jax.device_count() == 8
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        x = jax.device_put(jnp.arange(64, dtype=jnp.bfloat16).reshape(8, 8) / 7,
                           NamedSharding(mesh, P("data", "model")))
        ck = Checkpointer({str(tmp_path)!r})
        ck.save(1, {{"w": x}})
        target = NamedSharding(mesh, P("model", None))
        r, _ = ck.restore(1, template={{"w": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16, sharding=target)}})
        assert r["w"].sharding == target, r["w"].sharding
        assert r["w"].dtype == jnp.bfloat16
        assert np.asarray(r["w"]).tobytes() == np.asarray(x).tobytes()
        print("ok")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_relative_workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    state = _state()
    ck = Checkpointer("rel/run")
    ck.save(3, state, META)
    ck.wait()
    restored, meta = Checkpointer("rel/run", read_only=True).restore(template=state)
    _assert_exact(restored, state)
    assert meta == META and os.path.isdir(tmp_path / "rel" / "run" / "checkpoints")
