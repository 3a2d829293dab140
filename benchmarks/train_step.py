"""GRPO update-step throughput: marl_jax's jitted train step against a PyTorch reference, same rows, same run.

    python benchmarks/train_step.py [--rows=8 --micro_batch=4 --prompt_len=100 --completion_len=128 --reps=3]
    python benchmarks/train_step.py --skew --rows=16      # uneven lengths, as RL rows are
    python benchmarks/train_step.py --skew --rows=16 --packing --unpacked   # ... with sequence packing, and
                                                  # the unpacked step timed in the same rounds: packing_speedup=
    python benchmarks/train_step.py --episodes=4 --packing --share_prefix=16   # GRPO groups: 4 rows per
                                                  # prompt, laid over one copy of it (grpo.share_prefix)

The defaults keep a run near 6 minutes on 2 CPU cores; --rows=32 --micro_batch=8 is 4x the work per step.

Workload: --rows random-token rows (prompt ~--prompt_len tokens +-20%, completion 75-100% of
--completion_len) from --roles roles sharing one LoRA slot (rank 64, alpha 32, every linear layer) on
SmolLM2-135M-Instruct (embedded) in float32. Advantages are random and nonzero; old log-probs are the
starting policy's own plus N(0, 0.1) noise, so some tokens clip. --skew draws uneven rows instead, as RL
produces them: prompts of 70-500 tokens, completions log-uniform from 4 tokens to --completion_len. LoRA B starts at small random values
(a policy some steps into training) so that the adapters change the output and the loss check covers them.

marl_jax: make_train_step with UpdateConfig(diagnostics=False, metrics=False, remat=--remat,
length_buckets=--length_buckets, length_grid=--length_grid, dtype=--dtype, unroll=--unroll) is the headline;
the step with diagnostics and metrics on (exact per-role gradients from group-aligned micro-batches) is
reported after it. Each compiles its programs first, as launch/run.py's warm-up does, and is timed
after an untimed first call; the compile and first-call times are reported separately.
PyTorch, in a process of its own (so that each side's peak memory is its own):
transformers' LlamaForCausalLM from the same weights (float32, --threads threads), plain-torch
LoRA on every decoder nn.Linear with marl_jax's initial A/B, the same loss (PPO clip 0.2/0.28, dual
clip 3, seq-mean-token-mean), the same micro-batches (each padded to its own longest row, LM head on
completion positions only), grad-norm clipping 1.0 and AdamW as marl_jax's optimizer (betas 0.9/0.999, eps 1e-8, decay 0.01).
Each takes one untimed first step, then --reps timed steps, one side after the other (so that their
peak memory never adds up; marl_jax's free heap is handed back before PyTorch's turn); medians are
reported. The first-step losses of both are printed (they
agree to ~1e-6 relative when the computation is the same), and the losses after the AdamW updates.
Prints wall times per step, tokens/s, useful tokens (real prompt + completion) against the positions
each side computes (marl_jax: every micro-batch over its token window; PyTorch: every micro-batch
padded to its longest row), matmul FLOPs by part (base linears, attention, LoRA, LM head) useful and
executed, the marl_jax step's achieved FLOP/s next to a jitted f32 2048^2 matmul peak measured here,
and as its last line `speedup=<PyTorch step time / marl_jax step time>`.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import types

from common import PeakRSS, matmul_peak

# libgomp's default busy-waiting makes torch's 2 threads many times slower whenever another process
# holds a core (measured here: 5x on a forward pass); passive waiting costs little on an idle one.
# Set before torch is imported; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROLE_NAMES = ("generator", "evaluator", "voter", "worker")
# marl_jax LoRA target -> attribute path of the matching nn.Linear inside a transformers decoder layer.
HF_LINEAR = {"wq": ("self_attn", "q_proj"), "wk": ("self_attn", "k_proj"), "wv": ("self_attn", "v_proj"),
             "wo": ("self_attn", "o_proj"), "w_gate": ("mlp", "gate_proj"), "w_up": ("mlp", "up_proj"),
             "w_down": ("mlp", "down_proj")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=100, help="mean prompt length (varied +-20%%)")
    p.add_argument("--completion_len", type=int, default=128, help="max completion length (varied down to 75%%)")
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--roles", type=int, default=2, help="roles sharing the slot (diagnostic groups)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--reps", type=int, default=3, help="timed steps per implementation (after one warm-up)")
    p.add_argument("--diag_reps", type=int, default=1, help="timed diagnostics-on steps (0 skips them)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--remat", default="none", choices=("none", "dots", "full"),
                   help="marl_jax backward recomputation (none keeps every activation, as the PyTorch side does)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skew", action="store_true", help="uneven rows: prompts 70-500, completions 4..completion_len")
    p.add_argument("--length_buckets", type=int, default=4, help="marl_jax token windows per batch (1: all T)")
    p.add_argument("--length_grid", type=int, default=2,
                   help="marl_jax token window sizes per octave (grpo.length_grid; 16: steps of 8 near 128-256)")
    p.add_argument("--packing", action="store_true",
                   help="marl_jax packs each micro-batch's rows into fewer sequences (grpo.packing)")
    p.add_argument("--episodes", type=int, default=1,
                   help="rows per prompt: a GRPO group's episodes share their prompt (1: every prompt its own)")
    p.add_argument("--share_prefix", type=int, default=0,
                   help="with --packing: marl_jax lays rows sharing >= this many leading tokens over one copy "
                        "of them (grpo.share_prefix; 0: off)")
    p.add_argument("--unroll", action="store_true",
                   help="marl_jax runs the layers as straight-line code, not a loop (grpo.unroll: ~2x compile)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="marl_jax base-model compute dtype (adapters, gradients, optimizer stay float32)")
    p.add_argument("--unpacked", action="store_true",
                   help="with --packing: also time marl_jax's step without packing, in the same rounds "
                        "(packing_speedup=; its programs raise the process's peak memory)")
    p.add_argument("--max_tokens_per_micro_batch", type=int, default=0,
                   help="marl_jax micro-batches of as many rows as this many positions hold, not --micro_batch "
                        "rows (grpo.max_tokens_per_micro_batch; 0: off); PyTorch keeps --micro_batch rows")
    args = p.parse_args(argv)
    if args.rows < 1 or args.micro_batch < 1 or args.reps < 1:
        p.error("--rows, --micro_batch and --reps must be >= 1")
    if args.max_tokens_per_micro_batch < 0:
        p.error("--max_tokens_per_micro_batch must be >= 0 (0: off)")
    if args.episodes < 1 or args.share_prefix < 0:
        p.error("--episodes must be >= 1 and --share_prefix >= 0")
    if args.share_prefix and not args.packing:
        p.error("--share_prefix lays rows over shared prefixes in packed sequences: add --packing")
    if args.unpacked and not args.packing:
        p.error("--unpacked times the step without packing beside the packed one: add --packing")
    if not 1 <= args.roles <= len(ROLE_NAMES):
        p.error(f"--roles must be in 1..{len(ROLE_NAMES)}")
    return args


@dataclasses.dataclass
class Row:
    """The fields rl.batch.make_batch reads from a trajectory row."""

    prompt_tokens: list
    completion_tokens: list
    logprobs: list
    role: str
    call_index: int = 0
    trained: bool = True


def synth_rows(args: argparse.Namespace, vocab: int, special: set[int]) -> list[Row]:
    """Random-token rows with varied lengths (log-probs are filled in later)."""
    import numpy as np

    rng = np.random.RandomState(args.seed)
    ok = np.array([t for t in range(vocab) if t not in special])
    rows = []
    for i in range(args.rows):
        if args.skew:
            p = int(rng.randint(70, 501))
            c = int(round(np.exp(rng.uniform(np.log(4), np.log(args.completion_len)))))
        else:
            p = int(rng.randint(int(args.prompt_len * 0.8), int(args.prompt_len * 1.2) + 1))
            c = int(rng.randint(max(1, int(args.completion_len * 0.75)), args.completion_len + 1))
        k = i // args.episodes  # --episodes rows of one prompt, one role
        prompt = rows[-1].prompt_tokens if i % args.episodes else [int(t) for t in rng.choice(ok, p)]
        rows.append(Row(prompt, [int(t) for t in rng.choice(ok, c)], [], ROLE_NAMES[k % args.roles]))
    return rows


def start_lora(spec, cfg, base, seed: int):
    """marl_jax's initial adapters with B moved off zero (as after some training)."""
    import jax

    from marl_jax.policy.lora import init_trainable

    tr = init_trainable(spec, cfg, base, jax.random.PRNGKey(seed))
    key = jax.random.PRNGKey(seed + 1)
    out = {}
    for i, (name, ab) in enumerate(sorted(tr.items())):
        b = 0.01 * jax.random.normal(jax.random.fold_in(key, i), ab["b"].shape, ab["b"].dtype)
        out[name] = {"a": ab["a"], "b": b}
    return out


def step_flops(cfg, spec, body_tokens: float, ctx: float, head_tokens: float, parts: bool = False):
    """Matmul FLOPs of one forward + backward over `body_tokens` positions (keys per query: ctx) and
    the LM head on `head_tokens` positions, with frozen base weights and LoRA on spec's targets.

    Forward: ModelConfig.flops_per_token split into base linears, attention (q.k, p.v), LM head, plus
    LoRA (x A, (x A) B). Backward: 1x base linears and 1x LM head (activation gradients only, weights
    frozen), 2x attention (gradients of both operands), 2x LoRA (activation and A/B gradients).
    """
    d, V = cfg.hidden_size, cfg.vocab_size
    head = 2.0 * d * V
    lin = cfg.flops_per_token(0) - head
    att = cfg.flops_per_token(int(round(ctx))) - cfg.flops_per_token(0)
    io = {"wq": (d, cfg.q_dim), "wk": (d, cfg.kv_dim), "wv": (d, cfg.kv_dim), "wo": (cfg.q_dim, d),
          "w_gate": (d, cfg.intermediate_size), "w_up": (d, cfg.intermediate_size),
          "w_down": (cfg.intermediate_size, d)}
    lora = 2.0 * cfg.num_layers * spec.rank * sum(io[n][0] + io[n][1] for n in spec.target_names)
    split = {"base linears": body_tokens * 2 * lin, "attention": body_tokens * 3 * att,
             "LoRA": body_tokens * 3 * lora, "LM head": head_tokens * 2 * head}
    return split if parts else sum(split.values())


def packed_layouts(batch, plan):
    """The attention layout of every packed item of `plan` (rl.layout.plan_items), laid out by the update's own
    rl.update.item_rows and pack_item."""
    from marl_jax.models import attention as attn
    from marl_jax.rl.layout import Packed
    from marl_jax.rl.update import item_rows, pack_item

    out = []
    for it in plan:
        if isinstance(it.shape, Packed):
            _, seg = pack_item(item_rows(batch, it, head_on_scored=True), it.shape.p, it.shape.t)
            out.append(attn.shared_prefix(seg[0], seg[1]) if isinstance(seg, tuple) else attn.packed(seg))
    return out


def computed_positions(rows, mb: int, window) -> tuple[int, int]:
    """(body positions, attention query-key pairs) of micro-batches of `mb` rows in order, each over
    window(longest row of the micro-batch) positions."""
    pos = pairs = 0
    for s in range(0, len(rows), mb):
        chunk = rows[s:s + mb]
        t = window(max(len(r.prompt_tokens) + len(r.completion_tokens) for r in chunk))
        pos += len(chunk) * t
        pairs += len(chunk) * t * t
    return pos, pairs


# ---------------------------------------------------------------- PyTorch reference

def torch_lora_model(path: str, cfg, spec, trainable, threads: int):
    """LlamaForCausalLM from `path`, base frozen, every decoder nn.Linear wrapped with marl_jax's A/B."""
    import numpy as np
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.requires_grad_(False)
    scale = spec.scale

    class LoRALinear(torch.nn.Module):
        """y = base(x) + scale * (x A) B, A [in, r], B [r, out] (marl_jax's layout)."""

        def __init__(self, base: torch.nn.Linear, a: np.ndarray, b: np.ndarray):
            super().__init__()
            self.base = base
            self.a = torch.nn.Parameter(torch.tensor(np.array(a), dtype=torch.float32))
            self.b = torch.nn.Parameter(torch.tensor(np.array(b), dtype=torch.float32))

        def forward(self, x):
            return self.base(x) + (x @ self.a) @ self.b * scale

    lora_params = []
    for name in spec.target_names:
        parent_name, attr = HF_LINEAR[name]
        a, b = np.asarray(trainable[name]["a"][0]), np.asarray(trainable[name]["b"][0])
        for i, layer in enumerate(model.model.layers):
            parent = getattr(layer, parent_name)
            wrapped = LoRALinear(getattr(parent, attr), a[i], b[i])
            setattr(parent, attr, wrapped)
            lora_params += [wrapped.a, wrapped.b]
    if cfg.num_layers != len(model.model.layers):
        raise RuntimeError(f"exported model has {len(model.model.layers)} layers, expected {cfg.num_layers}")
    model.train()
    return model, lora_params


def torch_chunk_logprobs(model, chunk):
    """Completion-token log-probs of a micro-batch, padded to its longest row: ([N, W] logp, [N, W] mask).

    The LM head runs on the positions that predict completion tokens only.
    """
    import torch

    L = max(len(r.prompt_tokens) + len(r.completion_tokens) for r in chunk)
    W = max(len(r.completion_tokens) for r in chunk)
    n = len(chunk)
    ids, att = torch.zeros((n, L), dtype=torch.long), torch.zeros((n, L), dtype=torch.long)
    pos, tgt = torch.zeros((n, W), dtype=torch.long), torch.zeros((n, W), dtype=torch.long)
    mask = torch.zeros((n, W))
    for j, r in enumerate(chunk):
        seq = r.prompt_tokens + r.completion_tokens
        P, C = len(r.prompt_tokens), len(r.completion_tokens)
        ids[j, :len(seq)], att[j, :len(seq)] = torch.tensor(seq), 1
        # Position t predicts token t + 1: completion token k is predicted at P - 1 + k.
        pos[j] = torch.clamp(torch.arange(W) + P - 1, max=L - 1)
        tgt[j, :C], mask[j, :C] = torch.tensor(r.completion_tokens), 1.0
    h = model.model(input_ids=ids, attention_mask=att).last_hidden_state
    h = torch.gather(h, 1, pos[..., None].expand(-1, -1, h.shape[-1]))
    logp = torch.log_softmax(model.lm_head(h).float(), -1).gather(-1, tgt[..., None])[..., 0]
    return logp, mask


def torch_step(model, opt, params, rows, advs, mb: int, ucfg, den: float) -> float:
    """One GRPO update: micro-batched forward/backward, clip 1.0, AdamW. Returns the loss."""
    import torch

    total = 0.0
    for s in range(0, len(rows), mb):
        chunk = rows[s:s + mb]
        logp, mask = torch_chunk_logprobs(model, chunk)
        old = torch.zeros_like(logp)
        for j, r in enumerate(chunk):
            old[j, :len(r.logprobs)] = torch.tensor(r.logprobs)
        a = torch.tensor(advs[s:s + mb], dtype=torch.float32)[:, None]
        ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
        pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - ucfg.clip_low, 1 + ucfg.clip_high))
        pg = torch.where(a < 0, torch.minimum(pg, -a * ucfg.dual_clip), pg)
        row_mean = (pg * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # seq-mean-token-mean
        loss = row_mean.sum() / den
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def torch_worker(conn, path: str, cfg, spec, trainable, threads: int, mb: int) -> None:
    """The PyTorch side, in its own process: answers ("logprobs", rows) with each row's completion log-probs
    under the starting policy, ("setup", rows, advs, clip, den, lr) by building the optimizer, ("step",) with
    (loss, seconds, peak resident bytes of the step) and ("stop",) by returning."""
    import numpy as np
    import torch

    from common import PeakRSS

    model, params = torch_lora_model(path, cfg, spec, trainable, threads)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "logprobs":
            rows, out = msg[1], []
            with torch.no_grad():
                for s in range(0, len(rows), mb):
                    chunk = rows[s:s + mb]
                    logp, _ = torch_chunk_logprobs(model, chunk)
                    out += [logp[j, :len(r.completion_tokens)].numpy().astype(np.float64) for j, r in enumerate(chunk)]
            conn.send(out)
        elif msg[0] == "setup":
            rows, advs, clip, den, lr = msg[1:]
            opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
            conn.send("ok")
        elif msg[0] == "step":
            t = time.perf_counter()
            with PeakRSS() as rss:
                loss = torch_step(model, opt, params, rows, advs, mb, clip, den)
            conn.send((loss, time.perf_counter() - t, rss.peak))
        else:
            return


def trim_heap() -> None:
    """Hand this process's free heap memory back to the kernel (glibc's malloc_trim; a no-op elsewhere):
    under the run's allocator, which never trims, it would stay resident through the other side's steps."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class TorchSide:
    """The PyTorch reference in a child process (multiprocessing's spawn: a fresh interpreter, no jax state)."""

    def __init__(self, path: str, cfg, spec, trainable, threads: int, mb: int):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=torch_worker, args=(child, path, cfg, spec, trainable, threads, mb),
                                daemon=True)
        self.proc.start()
        self.peak = 0
        self._recv()  # "ready": the model is loaded (its directory may go)

    def _recv(self):
        if not self.conn.poll(3600):
            raise RuntimeError("the PyTorch process gave no answer within an hour")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the PyTorch process ended (exit code {self.proc.exitcode}; out of memory?)") from None

    def logprobs(self, rows):
        self.conn.send(("logprobs", rows))
        return self._recv()

    def setup(self, rows, advs, clip, den: float, lr: float):
        self.conn.send(("setup", rows, advs, clip, den, lr))
        self._recv()

    def step(self) -> tuple[float, float]:
        self.conn.send(("step",))
        loss, dt, peak = self._recv()
        self.peak = max(self.peak, peak)
        return loss, dt

    def close(self):
        self.conn.send(("stop",))
        self.proc.join(60)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from marl_jax.jax_setup import loaded_allocator
    from marl_jax.models import hf
    from marl_jax.models.loading import load_model
    from marl_jax.policy.lora import PolicySpec
    from marl_jax.rl import optim
    from marl_jax.rl.batch import make_batch, make_groups
    from marl_jax.rl.layout import item_windows, length_ladder, pack_batch, plan_items
    from marl_jax.rl.update import UpdateConfig, init_state, make_train_step
    from marl_jax.models import attention as attn

    t_start = time.perf_counter()
    print(f"load average at start (1/5/15 min, {os.cpu_count()} cores): "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f"; allocator: {loaded_allocator()}")
    m = load_model(args.model)
    cfg, tok = m.cfg, m.tokenizer
    base = jax.device_put(m.params)
    spec = PolicySpec(rank=args.rank, alpha=args.alpha, num_slots=1)
    trainable0 = start_lora(spec, cfg, base, args.seed)
    with tempfile.TemporaryDirectory() as d:
        hf.save_hf_dir(d, cfg, m.params)
        torch_side = TorchSide(d, cfg, spec, jax.tree_util.tree_map(np.asarray, trainable0), args.threads,
                               args.micro_batch)

    # Old log-probs: the starting policy's own (PyTorch forward, no graph) plus noise, so that the
    # ratio is near 1 and some tokens clip, as a few steps after sampling.
    rows = synth_rows(args, cfg.vocab_size, set(tok.eos_token_ids) | {tok.pad_id})
    t = time.perf_counter()
    noise = np.random.RandomState(args.seed + 7)
    for r, lp in zip(rows, torch_side.logprobs(rows)):
        r.logprobs = [float(x) for x in lp + noise.normal(0.0, 0.1, lp.shape)]
    old_s = time.perf_counter() - t
    adv_rng = np.random.RandomState(args.seed + 3)
    advs = adv_rng.choice([-1.0, 1.0], args.rows) * adv_rng.uniform(0.2, 1.5, args.rows)

    roles = list(ROLE_NAMES[:args.roles])
    role_to_slot = {r: 0 for r in roles}
    groups = make_groups(roles, role_to_slot, None)
    ucfg_off = UpdateConfig(micro_batch=args.micro_batch, diagnostics=False, metrics=False, remat=args.remat,
                            length_buckets=args.length_buckets, length_grid=args.length_grid, packing=args.packing,
                            share_prefix=args.share_prefix, unroll=args.unroll,
                            max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
                            dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32)
    batch = make_batch(rows, advs.astype(np.float32), role_to_slot=role_to_slot, num_slots=1, groups=groups,
                       micro_batch=args.micro_batch, pad_id=tok.pad_id, agg=ucfg_off.agg)
    batch = jax.tree_util.tree_map(jnp.asarray, batch)
    S, R, T = batch.tokens.shape
    W = batch.targets.shape[2]
    comp = sum(len(r.completion_tokens) for r in rows)
    total = sum(len(r.prompt_tokens) + len(r.completion_tokens) for r in rows)
    print(f"workload: {args.rows} rows ({args.roles} roles sharing one LoRA slot, rank {spec.rank} alpha "
          f"{spec.alpha} on {len(spec.target_names)} linears per layer), {total} real tokens of which {comp} "
          f"completion tokens; micro-batch {args.micro_batch}; marl_jax arrays [S={S}, R={R}, T={T}], LM-head "
          f"window W={W}; {args.model}, marl_jax computes in {args.dtype}; old log-probs = policy's + N(0, 0.1) "
          f"({old_s:.1f}s)")
    # Positions each side computes: marl_jax runs each (slot, micro-batch) item over its token window
    # (rl.update.item_windows), PyTorch pads each micro-batch of rows in order to its longest row.
    win = item_windows(batch.length, args.micro_batch, T, args.length_buckets, args.length_grid)
    mbr = min(args.micro_batch, R)
    jax_pos = int(win.sum()) * mbr
    jax_pairs = sum(attn.scored_pairs(attn.causal(np.ones((mbr, int(t)), bool))) for t in win.ravel() if t)
    jax_head = int((win > 0).sum()) * mbr * W
    packing_note = ""
    if args.packing:  # each item over (packed sequences x window) instead of (rows x window)
        pb = pack_batch(batch, args.micro_batch, share_prefix=args.share_prefix, grid=args.length_grid)
        plan = plan_items(pb, micro_batch=args.micro_batch, length_buckets=args.length_buckets,
                          grid=args.length_grid, packing=True, share_prefix=args.share_prefix, by_group=False)
        items = [tuple(it.shape) for it in plan]
        jax_pos = sum(p * t for p, t in items)
        jax_pairs = sum(attn.scored_pairs(lay) for lay in packed_layouts(pb, plan))
        packing_note = f"; packed (sequences x window) per micro-batch {items}"
    if args.max_tokens_per_micro_batch:  # the token budget's items replace the fixed micro-batches
        plan = plan_items(batch, micro_batch=args.micro_batch, length_buckets=args.length_buckets,
                          grid=args.length_grid, packing=args.packing, share_prefix=args.share_prefix,
                          max_tokens=args.max_tokens_per_micro_batch, by_group=False)
        jax_pos = sum(it.positions for it in plan)
        jax_pairs = sum(it.positions * it.shape.t for it in plan)
        jax_head = sum(len(it.rows) * W for it in plan)
        packing_note += (f"; token budget {args.max_tokens_per_micro_batch}: {len(plan)} micro-batches (rows, shape) "
                         f"{[(int((it.rows >= 0).sum()), tuple(it.shape)) for it in plan]}")
    torch_pos, torch_pairs = computed_positions(rows, args.micro_batch, lambda n: n)
    torch_head = sum(len(rows[s:s + args.micro_batch]) * max(len(r.completion_tokens) for r in rows[s:s + args.micro_batch])
                     for s in range(0, len(rows), args.micro_batch))
    print(f"positions computed per step (useful = {total} real tokens): marl_jax {jax_pos} "
          f"({jax_pos / total:.2f}x; token windows per micro-batch {sorted(int(x) for x in win.ravel() if x)}, "
          f"ladder {length_ladder(T, args.length_buckets, args.length_grid)}{packing_note}), pytorch {torch_pos} ({torch_pos / total:.2f}x); "
          f"over the whole T marl_jax would compute {S * R * T} ({S * R * T / total:.2f}x)")

    peak = matmul_peak()
    print(f"jitted f32 2048^2 matmul peak: {peak / 1e9:.1f} GFLOP/s")

    # ---- marl_jax ----
    tx = optim.per_slot(optim.make_optimizer(lr=args.lr, grad_clip=1.0))
    tables = dict(num_groups=len(groups.names), group_slot=groups.slot,
                  group_role=[roles.index(r) for r in groups.role], num_roles=len(roles),
                  role_slot=[role_to_slot[r] for r in roles])

    # marl_jax's peak resident memory while its timed steps run (PyTorch's is measured in its own process)
    jax_rss = PeakRSS()

    def jax_runner(ucfg, rss=None):
        """A fresh state and the step for ucfg, its programs compiled first as launch/run.py's warm-up does
        (train.warmup: all of them, before any runs; compiling between runs leaves a larger heap under the
        run's allocator); each call of the returned function is one timed step."""
        step = make_train_step(cfg, spec, ucfg, tx, **tables)
        box = [init_state(jax.tree_util.tree_map(jnp.array, trainable0), tx)]
        t = time.perf_counter()
        with rss or PeakRSS():
            n = step.warmup(box[0], base, T, W, workers=max(1, min(4, os.cpu_count() or 1)))
        warm = (n, time.perf_counter() - t)

        def run() -> tuple[float, float]:
            t = time.perf_counter()
            with rss or PeakRSS():
                box[0], met = step(box[0], base, batch)
                loss = float(met["loss"])  # blocks until the step is done
            dt = time.perf_counter() - t
            if not bool(met["finite"]):
                raise RuntimeError("marl_jax step produced a non-finite loss or gradient")
            return loss, dt
        run.warmup = warm
        return run

    # ---- PyTorch ----
    clip = types.SimpleNamespace(clip_low=ucfg_off.clip_low, clip_high=ucfg_off.clip_high, dual_clip=ucfg_off.dual_clip)
    torch_side.setup(rows, list(advs), clip, float(np.asarray(batch.den)[0]), args.lr)
    torch_run = torch_side.step

    # One side after the other, each an untimed first step then --reps timed ones: alternating, marl_jax's heap
    # stayed resident under PyTorch's steps (24 GB together on a 24 GiB machine, the kernel reclaiming pages
    # during the timings). With --unpacked, the unpacked step runs in marl_jax's turn.
    jax_step = jax_runner(ucfg_off, jax_rss)
    jl, jwarm = jax_step()
    jlosses, jtimes = [jl], []
    for _ in range(args.reps):
        jl, dt = jax_step()
        jlosses.append(jl)
        jtimes.append(dt)
    unpacked = jax_runner(dataclasses.replace(ucfg_off, packing=False, share_prefix=0)) if args.unpacked else None
    ul = unpacked()[0] if unpacked else None
    utimes = [unpacked()[1] for _ in range(args.reps)] if unpacked else []
    trim_heap()  # marl_jax's freed pages back to the kernel before PyTorch's turn
    tl, twarm = torch_run()
    tlosses, ttimes = [tl], []
    for _ in range(args.reps):
        tl, dt = torch_run()
        tlosses.append(tl)
        ttimes.append(dt)
    jmed, tmed = statistics.median(jtimes), statistics.median(ttimes)
    torch_side.close()

    # executed: marl_jax's windows (attention: the scores its kernel computes per item); useful: real tokens,
    # causal context
    exe_parts = step_flops(cfg, spec, jax_pos, jax_pairs / max(jax_pos, 1), jax_head, parts=True)
    ctx_real = sum((len(r.prompt_tokens) + len(r.completion_tokens)) ** 2 / 2 for r in rows) / total
    use_parts = step_flops(cfg, spec, total, ctx_real, comp, parts=True)
    tor_parts = step_flops(cfg, spec, torch_pos, torch_pairs / max(torch_pos, 1), torch_head, parts=True)
    exe, useful = sum(exe_parts.values()), sum(use_parts.values())
    print("TFLOP per step by part (useful / marl_jax executed / pytorch executed): " + "; ".join(
        f"{k} {use_parts[k] / 1e12:.3f} / {exe_parts[k] / 1e12:.3f} / {tor_parts[k] / 1e12:.3f}" for k in use_parts)
        + f"; total {useful / 1e12:.3f} / {exe / 1e12:.3f} / {sum(tor_parts.values()) / 1e12:.3f}"
        + (f" (+ the forward recomputed under remat={args.remat})" if args.remat != "none" else ""))
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
    print(f"marl_jax step (diagnostics off): median {jmed:.2f}s over {args.reps} ({fmt(jtimes)}); "
          f"warm-up compiling {jax_step.warmup[0]} programs {jax_step.warmup[1]:.1f}s, first call {jwarm:.1f}s")
    if unpacked:
        umed = statistics.median(utimes)
        print(f"marl_jax step without packing (token windows only, {int(win.sum()) * mbr} positions): median "
              f"{umed:.2f}s over {args.reps} ({fmt(utimes)}); first-step loss {ul:.7f} (packed {jlosses[0]:.7f}); "
              f"packing_speedup={umed / jmed:.2f}")
    version = importlib.metadata.version
    print(f"pytorch step ({args.threads} threads, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
          f"transformers {version('transformers')}, torch {version('torch')}): median {tmed:.2f}s over "
          f"{args.reps} ({fmt(ttimes)}); first step {twarm:.2f}s")
    print(f"peak resident memory while each side's steps ran (each in its own process): marl_jax {jax_rss.gb()}"
          f"{' (the unpacked step included)' if unpacked else ''}, pytorch {torch_side.peak / 1e9:.1f} GB")
    print(f"tokens/s, completion tokens: marl_jax {comp / jmed:.1f}, pytorch {comp / tmed:.1f}")
    print(f"tokens/s, all real tokens (prompt + completion): marl_jax {total / jmed:.1f}, pytorch {total / tmed:.1f}"
          f" (marl_jax computes {jax_pos} positions per step, {jax_pos / jmed:.1f}/s)")
    print(f"marl_jax achieved: {exe / jmed / 1e9:.1f} GFLOP/s executed ({exe / 1e12:.2f} TFLOP/step, "
          f"{100 * exe / jmed / peak:.0f}% of the matmul peak), {useful / jmed / 1e9:.1f} GFLOP/s useful "
          f"({useful / 1e12:.2f} TFLOP/step); pytorch {useful / tmed / 1e9:.1f} GFLOP/s useful")
    print("FLOP rule: matmuls only. Forward = base linears + attention (q.k, p.v) + LoRA (xA, (xA)B) at every "
          "position + LM head at scored positions. Backward = 1x base linears and 1x LM head (frozen weights: "
          "activation gradients only) + 2x attention + 2x LoRA (activation and A/B gradients). 'executed' counts "
          "marl_jax's token windows (attention: the scores its kernel computes, every t x t pair for dense, the "
          "visited blocks for blockwise; head on the W window); 'useful' counts "
          "real tokens with causal context and the head on completion tokens only")
    rel = abs(jlosses[0] - tlosses[0]) / max(abs(tlosses[0]), 1e-12)
    print(f"first-step loss: marl_jax {jlosses[0]:.7f}, pytorch {tlosses[0]:.7f} (relative difference {rel:.1e}); "
          f"step {len(jlosses)} (after {len(jlosses) - 1} AdamW updates): marl_jax {jlosses[-1]:.7f}, "
          f"pytorch {tlosses[-1]:.7f}")
    if rel > 1e-3:
        print("WARNING: the two first-step losses differ by more than 1e-3 relative: not the same computation")

    if args.diag_reps > 0:
        diag_step = jax_runner(dataclasses.replace(ucfg_off, diagnostics=True, metrics=True))
        dl0, dwarm = diag_step()
        dtimes = [diag_step()[1] for _ in range(args.diag_reps)]
        print(f"marl_jax step with diagnostics + metrics on ({len(groups.names)} role groups, group-aligned micro-batches"
              f"): median {statistics.median(dtimes):.2f}s over {args.diag_reps} ({fmt(dtimes)}); warm-up compiling "
              f"{diag_step.warmup[1]:.1f}s, first call {dwarm:.1f}s; first-step loss {dl0:.7f}")
    print("load average at end: " + " ".join(f"{x:.2f}" for x in os.getloadavg())
          + f"; whole run {time.perf_counter() - t_start:.0f}s")
    print(f"speedup={tmed / jmed:.2f}")


if __name__ == "__main__":
    from marl_jax.jax_setup import use_fast_allocator

    use_fast_allocator()  # XLA temporaries without a page fault per 4 KiB (MARL_JAX_MALLOC=off: glibc)
    sys.exit(main())
