"""The sampler's sizing rules, stated once: shape buckets (what compiles), the attention windows, and the paged
pool's size, growth and watermark. A leaf module (numpy only): the sampler, its scheduler and block pool, the
update's batcher and the planner all call these instead of restating them."""
from __future__ import annotations

from typing import Sequence


def length_bucket(n: int, minimum: int = 16) -> int:
    """Length bucket minimum * {1, 1.5} * 2^k: padding stays under half and only a few shapes compile."""
    b = minimum
    while True:
        if n <= b:
            return b
        if n <= b * 3 // 2:
            return b * 3 // 2
        b *= 2


def batch_bucket(n: int, minimum: int = 1, multiple: int = 1, per_octave: int = 2) -> int:
    """Batch size for n rows: `multiple` (the data axis) times 1, 2, 3, 4, 6, 8, 12, ... (2^k and 3 * 2^k),
    at least `minimum`. The 1.5x steps halve the rows compaction pays for between buckets, against
    powers of two, and keep the number of compiled shapes logarithmic. `per_octave` sizes between 2^k and
    2^(k+1) in general (2^k + i 2^k / per_octave): finer buckets waste fewer rows and compile more shapes."""
    need = max(n, minimum, 1)
    c = 1
    while True:
        for m in sorted({c + c * i // per_octave for i in range(per_octave)}):
            if m * multiple >= need:
                return m * multiple
        c *= 2


def next_smaller_bucket(B: int, minimum: int = 1, multiple: int = 1, per_octave: int = 2) -> int:
    """The largest batch bucket below B and at least `minimum` (0 when there is none)."""
    smaller = [c for c in range(minimum, B) if batch_bucket(c, minimum, multiple, per_octave) == c]
    return smaller[-1] if smaller else 0


def compaction_sizes(B: int, minimum: int = 1, multiple: int = 1, per_octave: int = 2) -> list[int]:
    """Every batch size compaction can move a batch of B rows to (the batch buckets of `per_octave` sizes per
    octave, and the coarse grid's, from `minimum` up to B), largest first: the decode batch sizes a call
    starting at B can run."""
    sizes = {B}
    for grid in {min(2, per_octave), per_octave}:
        sizes |= {c for c in range(max(minimum, 1), B) if batch_bucket(c, minimum, multiple, grid) == c}
    return sorted(sizes, reverse=True)


def compaction_moves(B: int, minimum: int = 1, multiple: int = 1, per_octave: int = 2) -> list[tuple[int, int]]:
    """The (from, to) batch sizes of every compaction a call starting at B can run: compaction steps down its
    grid (the coarse one, or the fine one after its patience) one size at a time."""
    return sorted({(b, c) for b in compaction_sizes(B, minimum, multiple, per_octave)
                   for grid in {min(2, per_octave), per_octave}
                   if (c := next_smaller_bucket(b, minimum, multiple, grid))}, reverse=True)


def refill_rows(B: int, multiple: int = 1) -> int:
    """Rows one refill prefills and inserts at a time under a CallShape (a call over rollout.max_batch: its
    admissions after the first run in chunks of this many, padded): an eighth of the batch of B, bucketed.
    One size, so the warm-up compiles a refilling call's programs before its first step."""
    return min(B, batch_bucket(max(1, B // 8), 1, multiple))


def refill_distinct(n: int, R: int, multiple: int = 1) -> int:
    """Distinct prompts a refill chunk of R rows prefills for n distinct ones: a power of two (times `multiple`)
    up to R, so at most twice the prompts and log2(R) + 1 programs."""
    return min(R, batch_bucket(n, 1, multiple, per_octave=1))


def refill_distinct_sizes(R: int, multiple: int = 1) -> list[int]:
    """Every refill_distinct a chunk of R rows can take: the refill prefills the warm-up compiles."""
    return sorted({refill_distinct(n, R, multiple) for n in range(1, R + 1)})


def resume_slots(g: int) -> int:
    """Cache slots after the prompt that a preempted row's re-prefill covers: its g - 1 tokens, bucketed."""
    return length_bucket(max(g - 1, 1))


PREFIX_BLOCK = 16  # tokens per prefix-cache block (the Sampler's default)
STORE_CHUNK = 512  # prefix-cache slots one store program writes: one program whatever a harvest stores


def decode_windows(P: int, Tn: int) -> tuple[int, ...]:
    """Attention windows (cache slots attended) for prompt bucket P and new-token bucket Tn: a quarter, a half
    and all of the new tokens, so early steps, where most row-steps are, skip the cache's empty end. Each
    window is a decode program to compile, so they are used only where the new tokens are most of the cache
    (long completions after short prompts); otherwise the one window is the whole cache."""
    if Tn < max(64, P):
        return (P + Tn,)
    return (P + Tn // 4, P + Tn // 2, P + Tn)


def pool_window(window: int, block: int, width: int) -> int:
    """A decode window over a paged pool: rounded up to whole blocks, at most a row's `width` slots."""
    return min(blocks_for(window, block) * block, width)


def call_windows(P: int, Tn: int, block: int = 0, kernel: bool = False) -> tuple[int, ...]:
    """The windows a call's decode runs over: decode_windows on a dense cache; over a paged pool of `block`-slot
    blocks each as pool_window makes it, or, where the paged kernel reads each row's own length, the whole row."""
    if not block:
        return decode_windows(P, Tn)
    width = blocks_for(P + Tn, block) * block
    if kernel:
        return (width,)
    return tuple(sorted({pool_window(w, block, width) for w in decode_windows(P, Tn)}))


def shared_prefix_len(prompts: Sequence[Sequence[int]], minimum: int = 16) -> int:
    """Length of the prefix every prompt shares, rounded down to a length bucket (so few programs compile)
    and leaving each prompt at least one token of its own (its last token's logits start decoding).
    0 when there is one prompt or the shared part is under `minimum` tokens."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        n = next((j for j in range(n) if p[j] != first[j]), n)
    if n < minimum:
        return 0
    b = minimum
    while length_bucket(b + 1, minimum) <= n:
        b = length_bucket(b + 1, minimum)
    return b


def cached_regions(P: int, block: int) -> tuple[int, ...]:
    """The cached regions C (slots loaded from prefix-cache blocks) a prefill under a prompt region of P slots
    may take: whole blocks at half and three quarters of P. A fixed set, so that its programs compile before
    the first call; a call's hits beyond the C it takes are prefilled again."""
    return tuple(sorted({P * q // 4 // block * block for q in (2, 3)} - {0}))


def hit_region(prompts: Sequence[Sequence[int]], cached: Sequence[int], P: int, block: int) -> int:
    """The largest of cached_regions(P, block) under which every prompt's tokens past its hits (cut at C) fit
    in the P - C slots after it; 0 when none does (the call then loads no hits)."""
    for C in reversed(cached_regions(P, block)):
        if all(len(p) - min(h, C) <= P - C for p, h in zip(prompts, cached)):
            return C
    return 0


# ---- the paged pool (counts per row shard; block 0 is each shard's null block) ----

def paged_by_default(backend: str) -> bool:
    """Which KV cache "auto" (rollout.paged_kv) means on a backend: the paged pool on TPU, where decode reads it
    in place through the paged-attention kernel at about the minimum bytes; the dense cache elsewhere (on CPU
    gathering the pool's blocks costs more than the dense window; on GPU until benchmarks/accelerator.py has
    measured the fused paged path against it)."""
    return backend == "tpu"


def blocks_for(slots: int, block: int) -> int:
    """Blocks that hold `slots` slots."""
    return -(-slots // block)


def full_pool_blocks(rows: int, P: int, Tn: int, block: int) -> int:
    """A shard's pool at its largest: every row's prompt and new-token slots (a dense cache's), + the null block."""
    return 1 + rows * blocks_for(P + Tn, block)


def first_pool_blocks(rows: int, distinct: int, P: int, Tn: int, block: int) -> int:
    """Blocks of a row shard's first paged pool: its distinct prompts' whole blocks once, each row's part of its
    prompt's last block and one block of growth (+1 null), rounded up to a size bucket, at most the full pool."""
    whole, per = P // block, blocks_for(P, block)
    return min(batch_bucket(1 + distinct * whole + rows * (per - whole + 1), 16), full_pool_blocks(rows, P, Tn, block))


def shape_pool_blocks(rows: int, distinct: int, P: int, Tn: int, block: int) -> int:
    """A row shard's pool when every row runs to its limit: its distinct prompts' whole blocks once and, per row,
    its part of its prompt's last block, its completion's blocks and one block taken ahead (+1 null), at most
    the full pool. The fixed size of a call sized by a CallShape (one pool size, so its programs compile once)
    and what the planner counts."""
    whole, per = P // block, blocks_for(P, block)
    return min(full_pool_blocks(rows, P, Tn, block),
               1 + min(distinct, rows) * whole + rows * (per - whole + blocks_for(Tn, block) + 1))


def grown_pool_blocks(N: int, short: int, full: int) -> int:
    """The pool's next size when a shard is `short` blocks short: at least 1.5x (few sizes, few programs), at
    most the full pool."""
    return min(batch_bucket(N + max(short, N // 2), 16), full)


def budget_pool_blocks(budget_bytes: int, block_bytes: int, full: int) -> int:
    """A KV budget's fixed pool: the blocks its bytes hold (the null block among them), at most the full pool."""
    return max(2, min(budget_bytes // block_bytes, full))


def watermark(N: int) -> int:
    """Blocks admission keeps free in a pool of N (1%, at least one), so running rows can grow before preemption."""
    return max(1, (N - 1) // 100)


def block_bytes(num_layers: int, kv_heads: int, head_dim: int, block: int, itemsize: int, model_devices: int = 1) -> int:
    """Bytes of one KV block (keys and values, every layer) on one device: KV heads split over "model" where
    they divide."""
    heads = kv_heads // model_devices if kv_heads % model_devices == 0 else kv_heads
    return 2 * num_layers * block * heads * head_dim * itemsize
