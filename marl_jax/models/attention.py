"""Attention: the one place that computes attention scores.

`attention(q, k, v, layout, impl=...)` takes queries [B, S, Hq, hd], keys and values [B, T, Hkv, hd]
(or the KV cache's own layout, see `kv_layout`) and a `Layout`: int arrays of query slots and segment
ids, never a [T, T] mask. A query at slot p of segment s (parent segment r) sees key t when

    t <= p  and  seg[t] > 0  and  seg[t] in {s, r}

which covers every layout the project uses: causal rows with padding (`causal`), rows packed end to end
(`packed`), rows laid over one copy of a shared prefix (`shared_prefix`), and a chunk of queries against
a KV cache window (`cached`). Queries that see no key get an unspecified finite output (padding).

Implementations (`impl`), chosen per backend by `choose`:
- "dense": scores [B, H, S, T] materialised; fastest for single-token decode and short rows.
- "blockwise": FlashAttention's algorithm in plain JAX, any backend, float32 or bfloat16: an online
  softmax over KV blocks, a custom VJP that saves the output and the log-sum-exp and recomputes each block
  in the backward, blocks that hold no visible pair (above the causal diagonal, or of other segments in
  packed rows) skipped, grouped-query attention without repeating K/V. Memory is O(T) per row.
  Written here because nothing maintained does this on CPU: `jax.nn.dot_product_attention`'s XLA path
  builds the full T x S logits, and tokamax's `xla_chunked` repeats K/V for GQA, differentiates through
  its chunks with plain AD, and skips no block of packed segments.
- "splash" (TPU): jax's Pallas splash attention, vmapped over rows, segment ids for padding and packing,
  GQA; under a mesh inside `shard_map`. Layouts it cannot express (shared-prefix parents, cache chunks)
  fall back to blockwise, said once in the log.
- "cudnn" (GPU): `jax.nn.dot_product_attention(implementation="cudnn")` with `is_causal` and sequence
  lengths (never a mask: it would become a dense bias) for right-padded causal rows in bfloat16 / float16;
  other layouts and float32 fall back to blockwise, said once in the log.
- "auto": dense for decode and rows whose scores are small, the backend's kernel above that, blockwise
  otherwise (on GPU dense up to 4096 x 4096 scores first: blockwise is slow there).

Decode over the sampler's paged KV pool (marl_jax.models.decoder.PagedCache) has two paths, chosen by
`choose(..., pool=True)` in the decoder's paged branch:
- "paged" (TPU): jax's Pallas paged-attention kernel (`paged_decode`) reads each row's pages in place,
  nothing of size rows x window is gathered. Taken by "auto" on TPU and by an explicit "splash" on any
  backend ("splash" means "the TPU kernels": splash for prefill and the update, this one for decode; on
  CPU only in Pallas interpret mode), for one query per row, a bfloat16 pool (the kernel loads pages as
  bfloat16) and rows whose valid slots are a prefix of their slots (a `cached` layout with right_padded:
  the kernel's only validity model is a length per row, no start offset, no holes). Under a mesh it runs
  per device in `shard_map`.
- "paged_fused" (GPU: "auto" there, or an explicit "cudnn" on any backend): `paged_fused`, the scores and
  the output as reductions whose operands index the pool in place, so a backend that fuses indexing into
  reductions reads each row's pages once. jax has no maintained paged decode kernel for GPU (its
  Pallas-Triton ops are deprecated; tokamax's kernels refuse paging).
- the gather path (everything else: CPU, float32 pools on TPU): each row's window of blocks is gathered
  to [B, W, Hkv, hd] and attended by the implementation chosen as for a dense cache (dense for decode).
  An explicit "splash" that cannot take the kernel says so once in the log.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.ad_checkpoint import checkpoint_name

IMPLS = ("auto", "dense", "blockwise", "splash", "cudnn")
# Blockwise tile: on CPU (forward + backward, 9 / 3 heads of 64) 128 beats 256 and 512 by 1.2-3.5x, at
# 1024 packed tokens (more blocks of other segments skipped) and at 4096 causal tokens alike.
BLOCK = 128
# blockwise residuals a remat policy may save by name (output, log-sum-exp)
SAVED_NAMES = ("attention_out", "attention_lse")
_NEG = -1e30  # masked score: finite, so fully masked rows stay NaN-free
log = logging.getLogger(__name__)


@struct.dataclass
class Layout:
    """Who sees whom. q_pos [B, S]: each query's slot on the key axis (causality); q_seg [B, S] and
    kv_seg [B, T]: segment ids (0 = padding, never seen); q_parent [B, S] or None: a second segment the
    query also sees (the shared prefix its row extends).

    kind (static): "causal" (one segment per row, q_pos = arange), "packed", "shared_prefix" or "cached"
    (a chunk of queries at given slots of a cache). right_padded (static): causal rows whose valid
    tokens are a prefix of the row (what cuDNN's sequence lengths can express)."""

    q_pos: jax.Array
    q_seg: jax.Array
    kv_seg: jax.Array
    q_parent: Any = None
    kind: str = struct.field(pytree_node=False, default="causal")
    right_padded: bool = struct.field(pytree_node=False, default=False)

    @property
    def aligned(self) -> bool:
        """Queries are the keys themselves (S == T, query i at slot i)."""
        return self.kind != "cached"

    def mask(self, T: int | None = None) -> jax.Array:
        """The dense [B, S, T] mask (dense attention and tests only)."""
        kv = self.kv_seg if T is None else self.kv_seg[:, :T]
        t = jnp.arange(kv.shape[1])
        m = (t[None, None, :] <= self.q_pos[:, :, None]) & (kv[:, None, :] > 0)
        same = kv[:, None, :] == self.q_seg[:, :, None]
        if self.q_parent is not None:
            same = same | (kv[:, None, :] == self.q_parent[:, :, None])
        return m & same


def causal(valid: jax.Array, right_padded: bool = False) -> Layout:
    """Causal rows; valid [B, T] marks real tokens (padding on either side)."""
    B, T = valid.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return Layout(pos, jnp.ones((B, T), jnp.int32), valid.astype(jnp.int32), None, "causal", right_padded)


def packed(segments: jax.Array) -> Layout:
    """Rows laid end to end: segments [B, T], one id > 0 per row, 0 for padding."""
    B, T = segments.shape
    seg = segments.astype(jnp.int32)
    return Layout(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), seg, seg, None, "packed")


def shared_prefix(segments: jax.Array, parents: jax.Array) -> Layout:
    """Packed rows that also see their parent segment (a prefix laid once before the rows extending it)."""
    lay = packed(segments)
    return lay.replace(q_parent=parents.astype(jnp.int32), kind="shared_prefix")


def cached(query_slot: jax.Array, kv_valid: jax.Array, right_padded: bool = False) -> Layout:
    """Queries at cache slots query_slot [B, S] over cache slots kv_valid [B, T] (True: holds a token).
    right_padded: the caller promises each row's valid slots are a prefix of its slots (no holes), what
    the paged-attention kernel's lengths can express."""
    B, S = query_slot.shape
    return Layout(query_slot.astype(jnp.int32), jnp.ones((B, S), jnp.int32), kv_valid.astype(jnp.int32), None,
                  "cached", right_padded)


def _acc(dtype):
    return jnp.promote_types(dtype, jnp.float32)


# ---- dense ----

def dense(q, k, v, layout: Layout, kv_layout: str = "bthd"):
    """Scores materialised. kv_layout "bthd": k, v [B, T, Hkv, hd]; "cache": k [B, Hkv, hd, T] and
    v [B, Hkv, T, hd], read as laid out (both products plain batched matmuls, no transpose)."""
    B, S, Hq, hd = q.shape
    if kv_layout == "cache":
        Hkv, T = k.shape[1], k.shape[3]
    else:
        T, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    mask = layout.mask(T)
    if kv_layout == "cache":
        qg = q.reshape(B, S, Hkv, g, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, g * S, hd)
        scores = jnp.matmul(qg, k, preferred_element_type=_acc(q.dtype)) / math.sqrt(hd)
        scores = jnp.where(mask[:, None, None], scores.reshape(B, Hkv, g, S, T), _NEG)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype).reshape(B, Hkv, g * S, T)
        out = jnp.matmul(probs, v).reshape(B, Hkv, g, S, hd)
        return out.transpose(0, 3, 1, 2, 4).reshape(B, S, Hq * hd)
    qg = q.reshape(B, S, Hkv, g, hd)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=_acc(q.dtype)) / math.sqrt(hd)
    scores = jnp.where(mask[:, None, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(B, S, Hq * hd)


# ---- blockwise (FlashAttention in plain JAX) ----

def _pad_to(x, axis, size, value=0):
    n = x.shape[axis]
    if n == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - n)
    return jnp.pad(x, widths, constant_values=value)


def _needed(layout: Layout, bq: int, bk: int, nq: int, nk: int):
    """[nq, nk] bool: KV block j may hold a key some query of block i sees (any row), from each block's
    slot and segment ranges: causal (the block's first key slot <= the queries' last slot) and segment
    intervals overlapping. Conservative (never drops a needed block); exact for contiguous segments."""
    S, T = nq * bq, nk * bk
    qpos = _pad_to(layout.q_pos, 1, S, -1).reshape(-1, nq, bq)
    big = jnp.iinfo(jnp.int32).max

    def rng(x, valid, shape):  # per-block [min, max] over valid entries
        x = x.reshape(shape)
        valid = valid.reshape(shape)
        return jnp.where(valid, x, big).min(-1), jnp.where(valid, x, -1).max(-1)

    qvalid = qpos >= 0
    qseg = _pad_to(layout.q_seg, 1, S).reshape(-1, nq, bq)
    qlo, qhi = rng(qseg, qvalid & (qseg > 0), qseg.shape)
    kseg = _pad_to(layout.kv_seg, 1, T)
    klo, khi = rng(kseg, kseg > 0, (-1, nk, bk))
    overlap = (qlo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= qhi[:, :, None])
    if layout.q_parent is not None:
        par = _pad_to(layout.q_parent, 1, S).reshape(-1, nq, bq)
        plo, phi = rng(par, qvalid & (par > 0), par.shape)
        overlap |= (plo[:, :, None] <= khi[:, None, :]) & (klo[:, None, :] <= phi[:, :, None])
    last = jnp.where(qvalid, qpos, -1).max(-1)  # [B, nq]
    first_key = jnp.arange(nk) * bk
    return ((first_key[None, None, :] <= last[:, :, None]) & overlap).any(0)


def _visits(needed):
    """Per q block, the KV blocks to visit: ([nq, nk] their indices, needed ones first; [nq] how many).
    A loop over this list runs no branch per block and steps over nothing between needed blocks."""
    order = jnp.argsort(~needed, axis=1, stable=True).astype(jnp.int32)
    return order, needed.sum(1).astype(jnp.int32)


def _blocks(q, k, v, layout: Layout, bq: int, bk: int):
    """Pad to whole blocks and split, head-major so that every per-block product is a plain batched matmul
    (no transpose inside the loop): q [nq, B, Hkv, g * bq, hd], k / v [nk, B, Hkv, bk, hd], the layout
    [nq, B, bq] / [nk, B, bk]."""
    B, S, Hq, hd = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    nq, nk = -(-S // bq), -(-T // bk)
    qb = (_pad_to(q, 1, nq * bq).reshape(B, nq, bq, Hkv, g, hd).transpose(1, 0, 3, 4, 2, 5)
          .reshape(nq, B, Hkv, g * bq, hd))
    kb = _pad_to(k, 1, nk * bk).reshape(B, nk, bk, Hkv, hd).transpose(1, 0, 3, 2, 4)
    vb = _pad_to(v, 1, nk * bk).reshape(B, nk, bk, Hkv, hd).transpose(1, 0, 3, 2, 4)
    qpos = _pad_to(layout.q_pos, 1, nq * bq, -1).reshape(B, nq, bq).transpose(1, 0, 2)
    qseg = _pad_to(layout.q_seg, 1, nq * bq).reshape(B, nq, bq).transpose(1, 0, 2)
    qpar = None if layout.q_parent is None else _pad_to(layout.q_parent, 1, nq * bq).reshape(B, nq, bq).transpose(1, 0, 2)
    kseg = _pad_to(layout.kv_seg, 1, nk * bk).reshape(B, nk, bk).transpose(1, 0, 2)
    return qb, kb, vb, (qpos, qseg, qpar, kseg), nq, nk, g


def _bias(lb, i, j, bk: int, dt):
    """[B, 1, 1, bq, bk] additive mask of q block i against KV block j: 0 where visible, _NEG elsewhere
    (one add per score instead of two selects; a query that has seen no key keeps m near _NEG)."""
    qpos, qseg, qpar, kseg = lb
    kp = j * bk + jnp.arange(bk)
    ks = kseg[j]
    qp, qs = qpos[i], qseg[i]
    m = (kp[None, None, :] <= qp[:, :, None]) & (ks[:, None, :] > 0)
    same = ks[:, None, :] == qs[:, :, None]
    if qpar is not None:
        same = same | (ks[:, None, :] == qpar[i][:, :, None])
    return jnp.where(m & same, 0.0, _NEG).astype(dt)[:, None, None]


def _fwd(q, k, v, layout: Layout, bq: int, bk: int):
    B, S, Hq, hd = q.shape
    acc_t = _acc(q.dtype)
    scale = 1.0 / math.sqrt(hd)
    qb, kb, vb, lb, nq, nk, g = _blocks(q, k, v, layout, bq, bk)
    Hkv = kb.shape[2]
    needed = _needed(layout, bq, bk, nq, nk)
    order, count = _visits(needed)

    def q_block(i):
        qi = qb[i]

        def visit(n, carry):
            m, l, acc = carry
            j = order[i, n]
            s = jnp.einsum("bhqd,bhtd->bhqt", qi, kb[j], preferred_element_type=acc_t).reshape(B, Hkv, g, bq, bk)
            s = s * scale + _bias(lb, i, j, bk, acc_t)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            l = l * alpha + p.sum(-1)
            pv = jnp.einsum("bhqt,bhtd->bhqd", p.reshape(B, Hkv, g * bq, bk).astype(v.dtype), vb[j],
                            preferred_element_type=acc_t)
            return m_new, l, acc * alpha.reshape(B, Hkv, g * bq, 1) + pv

        init = (jnp.full((B, Hkv, g, bq), _NEG, acc_t), jnp.zeros((B, Hkv, g, bq), acc_t),
                jnp.zeros((B, Hkv, g * bq, hd), acc_t))
        m, l, acc = jax.lax.fori_loop(0, count[i], visit, init)
        seen = m > 0.5 * _NEG  # has seen a key (m of a query that has seen none stays at _NEG)
        safe = jnp.where(seen, l, 1.0)
        out = acc / safe.reshape(B, Hkv, g * bq, 1)
        lse = jnp.where(seen, m + jnp.log(safe), jnp.inf)  # inf: p = exp(s - inf) = 0 in the backward
        return out, lse
    out, lse = jax.lax.map(q_block, jnp.arange(nq))  # [nq, B, Hkv, g * bq, hd], [nq, B, Hkv, g, bq]
    o = (out.reshape(nq, B, Hkv, g, bq, hd).transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * bq, Hq, hd)[:, :S]
         .astype(q.dtype))
    return o, lse


def _bwd(q, k, v, layout: Layout, o, lse, do, bq: int, bk: int):
    B, S, Hq, hd = q.shape
    T = k.shape[1]
    acc_t = _acc(q.dtype)
    scale = 1.0 / math.sqrt(hd)
    qb, kb, vb, lb, nq, nk, g = _blocks(q, k, v, layout, bq, bk)
    Hkv = kb.shape[2]
    dob = _blocks(do, k, v, layout, bq, bk)[0]
    needed = _needed(layout, bq, bk, nq, nk)
    order, count = _visits(needed)
    dsum = (do.astype(acc_t) * o.astype(acc_t)).sum(-1)  # [B, S, Hq]
    dsum = _pad_to(dsum, 1, nq * bq).reshape(B, nq, bq, Hkv, g).transpose(1, 0, 3, 4, 2)  # [nq, B, Hkv, g, bq]

    def q_block(carry, i):
        dk, dv = carry
        qi, doi, lsei, di = qb[i], dob[i], lse[i], dsum[i]

        def visit(n, c):
            dq, dk, dv = c
            j = order[i, n]
            kj, vj = kb[j], vb[j]
            s = jnp.einsum("bhqd,bhtd->bhqt", qi, kj, preferred_element_type=acc_t).reshape(B, Hkv, g, bq, bk)
            p = jnp.exp(s * scale + _bias(lb, i, j, bk, acc_t) - lsei[..., None])
            p2 = p.reshape(B, Hkv, g * bq, bk)
            dvj = jnp.einsum("bhqt,bhqd->bhtd", p2.astype(do.dtype), doi, preferred_element_type=acc_t)
            dp = jnp.einsum("bhqd,bhtd->bhqt", doi, vj, preferred_element_type=acc_t).reshape(B, Hkv, g, bq, bk)
            ds = (p * (dp - di[..., None]) * scale).reshape(B, Hkv, g * bq, bk)
            dq = dq + jnp.einsum("bhqt,bhtd->bhqd", ds.astype(q.dtype), kj, preferred_element_type=acc_t)
            dkj = jnp.einsum("bhqt,bhqd->bhtd", ds.astype(q.dtype), qi, preferred_element_type=acc_t)
            return dq, dk.at[j].add(dkj), dv.at[j].add(dvj)

        dq, dk, dv = jax.lax.fori_loop(0, count[i], visit, (jnp.zeros(qi.shape, acc_t), dk, dv))
        return (dk, dv), dq
    zeros = jnp.zeros((nk, B, Hkv, bk, hd), acc_t)
    (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), jnp.arange(nq))
    dq = dq.reshape(nq, B, Hkv, g, bq, hd).transpose(1, 0, 4, 2, 3, 5).reshape(B, nq * bq, Hq, hd)[:, :S]
    dk = dk.transpose(1, 0, 3, 2, 4).reshape(B, nk * bk, Hkv, hd)[:, :T]
    dv = dv.transpose(1, 0, 3, 2, 4).reshape(B, nk * bk, Hkv, hd)[:, :T]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _flash(q, k, v, layout, bq, bk):
    return _fwd(q, k, v, layout, bq, bk)[0]


def _flash_fwd(q, k, v, layout, bq, bk):
    o, lse = _fwd(q, k, v, layout, bq, bk)
    # Named so that a remat policy can keep them (the decoder's "dots" does): O(T) each, and without them
    # the backward pass reruns the whole forward loop.
    o, lse = checkpoint_name(o, SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])
    return o, (q, k, v, layout, o, lse)


def _flash_bwd(bq, bk, res, do):
    q, k, v, layout, o, lse = res
    dq, dk, dv = _bwd(q, k, v, layout, o, lse, do, bq, bk)
    zero = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, jax.dtypes.float0), layout)
    return dq, dk, dv, zero


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise(q, k, v, layout: Layout, block_q: int = BLOCK, block_kv: int = BLOCK):
    """FlashAttention over blocks of block_q queries and block_kv keys (shrunk to the row length)."""
    B, S, Hq, hd = q.shape
    bq = min(block_q, S)
    bk = min(block_kv, k.shape[1])
    return _flash(q, k, v, layout, bq, bk).reshape(B, S, Hq * hd)


# ---- TPU: Pallas splash attention ----

def splash(q, k, v, layout: Layout, *, interpret: bool = False, block: int = 512, mesh=None):
    """jax's Pallas splash attention (segment ids for padding and packing, GQA), vmapped over rows.
    Layouts it cannot express fall back to blockwise."""
    B, S, Hq, hd = q.shape
    T, Hkv = k.shape[1], k.shape[2]
    if not _splash_can(layout, S, T):
        _once(f"splash attention cannot express a {layout.kind!r} layout at {S}x{T} tokens "
              "(needs query = key rows, a multiple of 128 tokens, no parent segments): blockwise instead")
        return blockwise(q, k, v, layout)
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    b = math.gcd(T, block)
    sizes = sk.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(Hq)])
    kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    # Padding keys get an id no query has (-1), so they are never seen; queries keep theirs.
    kv_seg = jnp.where(layout.kv_seg > 0, layout.kv_seg, -1)

    def rows(q, k, v, q_seg, kv_seg):
        ids = sk.SegmentIds(q=q_seg, kv=kv_seg)
        one = lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids)
        qs = (q * (1.0 / math.sqrt(hd))).astype(q.dtype).transpose(0, 2, 1, 3)
        out = jax.vmap(one)(qs, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), ids)
        return out.transpose(0, 2, 1, 3)

    if mesh is not None:
        from jax.sharding import PartitionSpec as P
        from marl_jax.models.axes import ROW_AXES
        rows_ax = tuple(a for a in ROW_AXES if mesh.shape.get(a, 1) > 1) or None
        heads = "model" if mesh.shape.get("model", 1) > 1 and Hkv % mesh.shape["model"] == 0 else None
        spec = P(rows_ax, None, heads, None)
        ids = P(rows_ax, None)
        rows = jax.shard_map(rows, mesh=mesh, in_specs=(spec, spec, spec, ids, ids), out_specs=spec,
                             check_vma=False)
    return rows(q, k, v, layout.q_seg, kv_seg).reshape(B, S, Hq * hd)


# ---- TPU: Pallas paged attention (decode over a paged KV pool) ----

def _paged_block(pages_per_row: int, cap: int = 8) -> int:
    """Pages per compute block of the kernel: the largest divisor of a row's page count up to `cap`."""
    return max(d for d in range(1, min(cap, pages_per_row) + 1) if pages_per_row % d == 0)


def paged_decode(q, k_pool, v_pool, layer, table, lengths, *, interpret: bool = False, mesh=None):
    """One query per row over a paged KV pool, with jax's Pallas paged-attention kernel (TPU).

    q [B, 1, Hq, hd]; k_pool, v_pool: the whole stacked pool [Hkv, L, D, N, blk, hd] (marl_jax.models.decoder.
    PagedCache: D row shards of N blocks, row b in shard b // (B / D)); layer: which layer (traced); table
    [B, M]: each row's blocks in its shard; lengths [B] int32: row b sees its slots [0, lengths[b]). The kernel's
    validity model is that prefix and nothing else (no start offset, no holes): the sampler's pool holds rows
    compacted (token p in slot p). Returns [B, 1, Hq * hd].

    The pool reaches the kernel without a copy: it reshapes for free (a bitcast) to the kernel's pages [Hkv,
    L * D * N, blk, hd], and a row's page j of layer l is page (l * D + shard) * N + table[j], so nothing is
    sliced out per layer. Compiled for a v5p chip a whole decode step then moves about 1.1x its minimum bytes
    (benchmarks/decode_bytes.py); slicing the layer out of the stacked pool and viewing it as pages was two
    copies of the layer's pool per step, and a pool with a block's heads in its lanes needs each query placed
    in its head's lanes (Hkv times the queries' and outputs' bytes).

    Precision: the kernel rounds keys and values to bfloat16 as it loads them (its dequantisation step),
    so it equals the gather path exactly only for a bfloat16 pool; `choose` takes it only then.
    Under a mesh it runs per device inside `shard_map` (rows over the row axes, KV heads over "model"
    when they divide), each device over its own pool part."""
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    B, S, Hq, hd = q.shape
    if S != 1:
        raise ValueError(f"paged_decode takes one query per row, got {S}")

    def run(q, k_pool, v_pool, table, lengths, layer):
        Hkv, L, D, N, blk, _ = k_pool.shape
        Bl, M = table.shape
        shard = jnp.arange(Bl) // (Bl // D)
        pages = (layer * D + shard[:, None]) * N + table
        view = lambda pool: pool.reshape(Hkv, L * D * N, blk, hd)
        if interpret and mesh is not None:
            # jax's TPU interpreter on CPU deadlocks (in its buffer allocation callback) when the kernel inside
            # shard_map is handed the whole pool operand; there the layer is sliced out first. The whole-pool
            # page arithmetic is what the one-device interpreted tests and the compiled TPU program run.
            view = lambda pool: jax.lax.dynamic_index_in_dim(pool, layer, 1, keepdims=False).reshape(
                Hkv, D * N, blk, hd)
            pages = shard[:, None] * N + table
        qs = (q[:, 0] * (1.0 / math.sqrt(hd))).astype(q.dtype)

        def call():
            # A filler row holds no slot (length 0): it reads its null block's first slot instead of
            # dividing by an empty softmax (its output is never used).
            return paged_attention(qs, view(k_pool), view(v_pool), jnp.maximum(lengths, 1).astype(jnp.int32),
                                   pages.astype(jnp.int32), pages_per_compute_block=_paged_block(M))

        if interpret:
            from jax.experimental.pallas import tpu as pltpu
            with pltpu.force_tpu_interpret_mode():
                out = call()
        else:
            out = call()
        return out.reshape(Bl, 1, -1).astype(q.dtype)

    if mesh is not None:
        from jax.sharding import PartitionSpec as P
        from marl_jax.models.axes import ROW_AXES
        Hkv = k_pool.shape[0]
        rows_ax = tuple(a for a in ROW_AXES if mesh.shape.get(a, 1) > 1) or None
        heads = "model" if mesh.shape.get("model", 1) > 1 and Hkv % mesh.shape["model"] == 0 else None
        pool = P(heads, None, rows_ax, None, None, None)
        run = jax.shard_map(run, mesh=mesh, in_specs=(P(rows_ax, None, heads, None), pool, pool,
                                                      P(rows_ax, None), P(rows_ax), P()),
                            out_specs=P(rows_ax, None, heads), check_vma=False)
    return run(q, k_pool, v_pool, table, lengths, jnp.asarray(layer, jnp.int32))


def paged_fused(q, k_pool, v_pool, layer, table, lengths):
    """One query per row over the stacked paged pool (as paged_decode takes it) in plain XLA, written so that
    each row's pages are read once: the scores and the output are reductions (multiply and sum, not dots)
    whose operands index the pool in place, so a backend that fuses the indexing into the reduction (XLA:GPU's
    input fusion) never materialises the gathered rows; the gather path (paged_read, then dense attention)
    writes them out and reads them back, three passes over the window's keys and values. Rows past their
    length read their table's null block. Correct on every backend (tests compare it with the gather path);
    whether it is the fastest GPU path is measured by benchmarks/accelerator.py. Returns [B, 1, Hq * hd]."""
    B, S, Hq, hd = q.shape
    if S != 1:
        raise ValueError(f"paged_fused takes one query per row, got {S}")
    Hkv, L, D, N, blk, _ = k_pool.shape
    g = Hq // Hkv
    W = table.shape[1] * blk
    acc = _acc(q.dtype)

    def pages(pool):  # each row's window of its shard's pages, [Hkv, B, W, 1, hd]; by shard, as paged_read
        if D == 1:
            x = pool[:, layer, 0, table]
        else:
            x = jax.vmap(lambda p, t: p[:, layer, t], in_axes=(2, 0), out_axes=1)(pool, table.reshape(D, B // D, -1))
        return x.reshape(Hkv, B, W, 1, hd)

    qg = (q[:, 0].astype(acc) * (1.0 / math.sqrt(hd))).reshape(B, Hkv, g, hd).transpose(1, 0, 2, 3)[:, :, None]
    scores = jnp.sum(qg * pages(k_pool).astype(acc), axis=-1)  # [Hkv, B, W, g]
    seen = jnp.arange(W)[None] < jnp.maximum(lengths, 1)[:, None]
    scores = jnp.where(seen[None, :, :, None], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=2)
    out = jnp.sum(probs[..., None] * pages(v_pool).astype(acc), axis=2)  # [Hkv, B, g, hd]
    return out.transpose(1, 0, 2, 3).reshape(B, 1, Hq * hd).astype(q.dtype)


# ---- GPU: cuDNN ----

def cudnn(q, k, v, layout: Layout):
    """cuDNN's fused attention for right-padded causal rows (sequence lengths, never a mask)."""
    B, S, Hq, hd = q.shape
    if not _cudnn_can(layout, q.dtype):
        _once(f"cuDNN attention needs right-padded causal rows in bfloat16/float16 (got a {layout.kind!r} "
              f"layout, right_padded={layout.right_padded}, {q.dtype}): blockwise instead")
        return blockwise(q, k, v, layout)
    lengths = layout.kv_seg.sum(-1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(q, k, v, scale=1.0 / math.sqrt(hd), is_causal=True,
                                       query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                       implementation="cudnn")
    return out.reshape(B, S, Hq * hd)


_said: set = set()


def _once(msg: str):
    if msg not in _said:
        _said.add(msg)
        log.warning(msg)


# Dense while a row's scores stay under this many elements per head (S x T). On CPU
# (benchmarks/attention.py, forward + backward, one layer) the two tie at 512 tokens and blockwise is
# 1.7x faster at 1024 (2.3x on packed rows, whose other segments' blocks it skips).
DENSE_MAX_SCORES = 512 * 512
# On GPU, for layouts cuDNN cannot express (packed rows, shared prefixes, cache chunks, float32), dense up
# to this: blockwise's loop of small per-block kernels is slow there. One H200, forward + backward of one
# row, 16 / 8 heads of 128, bfloat16 (benchmarks/accelerator.py, docs/results/accelerator/): dense 6.4 ms
# vs blockwise 39 ms at 4096 tokens (2.5 GiB of temporaries vs 0.1), 95 ms vs 538 ms at 16384 (40 GiB).
GPU_DENSE_MAX_SCORES = 4096 * 4096


def _splash_can(layout: Layout, S: int, T: int) -> bool:
    return layout.kind in ("causal", "packed") and S == T and T % 128 == 0


def _cudnn_can(layout: Layout, dtype) -> bool:
    return layout.kind == "causal" and layout.right_padded and dtype in (jnp.bfloat16, jnp.float16)


def _paged_can(layout: Layout | None, S: int, dtype) -> bool:
    return S == 1 and dtype == jnp.bfloat16 and (layout is None or (layout.kind == "cached" and layout.right_padded))


def choose(impl: str, S: int, T: int, backend: str | None = None, layout: Layout | None = None,
           dtype=jnp.bfloat16, pool: bool = False) -> str:
    """The implementation `impl` runs as. "auto": dense for decode and small scores; above that the
    backend's kernel where it can express the layout (splash on TPU, cuDNN on GPU), blockwise otherwise.
    Other names are returned as given (an explicit kernel that cannot express a layout falls back itself,
    and says so).

    pool: the keys and values are read from a paged pool (dtype: the pool's). Decode over it is "paged"
    (jax's Pallas paged-attention kernel, `paged_decode`) with "auto" on TPU and with an explicit "splash"
    on any backend ("splash" means "the TPU kernels"; on CPU only in Pallas interpret mode), when the
    layout is one it expresses (one query per row, each row's valid slots a prefix: a `cached` layout with
    right_padded, a bfloat16 pool). On GPU ("auto" there, or an explicit "cudnn" anywhere) it is
    "paged_fused" (`paged_fused`: reductions over the pages indexed in place). Otherwise the pool's blocks
    are gathered and attended as below."""
    if impl not in IMPLS:
        raise ValueError(f"model.attention must be one of {IMPLS}, got {impl!r}")
    if pool and (impl == "splash" or (impl == "auto" and (backend or jax.default_backend()) == "tpu")):
        if _paged_can(layout, S, dtype):
            return "paged"
        if impl == "splash" and S == 1:
            _once(f"the paged-attention kernel needs one query per row, rows whose valid slots are a prefix "
                  f"(right_padded) and a bfloat16 pool (got right_padded={getattr(layout, 'right_padded', None)}, "
                  f"{jnp.dtype(dtype).name}): decode gathers the pool's blocks instead")
    gpu = (backend or jax.default_backend()) in ("gpu", "cuda", "rocm")
    if pool and S == 1 and (impl == "cudnn" or (impl == "auto" and gpu)) and (
            layout is None or (layout.kind == "cached" and layout.right_padded)):
        return "paged_fused"  # "cudnn" means "the GPU paths", as "splash" means the TPU kernels
    if impl in ("splash", "cudnn") and S == 1:  # decode: one query per row, nothing for a kernel to tile
        return "dense"
    if impl != "auto":
        return impl
    if S == 1 or S * T <= DENSE_MAX_SCORES:
        return "dense"
    backend = backend or jax.default_backend()
    if backend == "tpu" and (layout is None or _splash_can(layout, S, T)):
        return "splash"
    if backend in ("gpu", "cuda", "rocm"):
        if layout is None or _cudnn_can(layout, dtype):
            return "cudnn"
        if S * T <= GPU_DENSE_MAX_SCORES:
            return "dense"
    return "blockwise"


def scored_pairs(layout: Layout, impl: str = "auto", *, backend: str | None = None,
                 block_q: int = BLOCK, block_kv: int = BLOCK) -> int:
    """Query-key pairs whose scores `attention` computes for this layout (benchmarks' FLOP counts): every
    pair for dense, the visited blocks' pairs for blockwise (the same per row of a batch: a block any row
    needs is computed for all). Kernels on other backends are counted as blockwise."""
    B, S = layout.q_pos.shape
    T = layout.kv_seg.shape[1]
    if choose(impl, S, T, backend=backend, layout=layout, dtype=jnp.float32) == "dense":
        return B * S * T
    bq, bk = min(block_q, S), min(block_kv, T)
    needed = _needed(layout, bq, bk, -(-S // bq), -(-T // bk))
    return int(np.asarray(needed).sum()) * B * bq * bk


def attention(q, k, v, layout: Layout, impl: str = "auto", *, kv_layout: str = "bthd", mesh=None,
              block_q: int = BLOCK, block_kv: int = BLOCK, interpret: bool = False):
    """Grouped-query attention of q [B, S, Hq, hd] over k, v ([B, T, Hkv, hd], or the cache layout with
    kv_layout="cache"). Returns [B, S, Hq * hd]."""
    T = k.shape[3] if kv_layout == "cache" else k.shape[1]
    name = choose(impl, q.shape[1], T, layout=layout, dtype=q.dtype)
    if name == "dense":
        return dense(q, k, v, layout, kv_layout)
    if kv_layout == "cache":  # the kernels read [B, T, Hkv, hd]
        k, v = k.transpose(0, 3, 1, 2), v.transpose(0, 2, 1, 3)
    if name == "blockwise":
        return blockwise(q, k, v, layout, block_q, block_kv)
    if name == "splash":
        return splash(q, k, v, layout, interpret=interpret, mesh=mesh)
    return cudnn(q, k, v, layout)
