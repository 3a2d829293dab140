"""Bytes a compiled XLA program moves, and its matmul FLOPs, counted from its optimized HLO text
(`compiled.as_text()`).

    from marl_jax import hlo_bytes
    r = hlo_bytes.analyze(jax.jit(f).lower(*args).compile().as_text())
    r.total, r.step, r.by_opcode("step"), r.top(10, "step"), r.copy_bytes("step"); print(r.format())
    r.flops, r.step_flops, r.matmuls(10), r.custom_calls()

Matmul FLOPs (`flops`, `step_flops`; per instruction `Record.flops`), in the same walk as the bytes, so loops
weigh their trip counts (cost_analysis's "flops" counts a loop body once: for a layer scan that is one layer):
  - dot: 2 x output elements x contracted size (the product of the lhs contracting dimensions);
  - convolution (XLA:TPU writes matmuls as convolutions, dim_labels=bf_io->bf, inside fusions): XLA's
    HloCostAnalysis rule, 2 x (input features / feature groups) x output features x (input batch / batch
    groups) x, per spatial dimension, the (output, kernel) position pairs that land on an input element
    (padding, strides, dilations); for a matmul that is 2 x output elements x the contracted size;
  - both inside fusions (nested fusions and calls in them included), counted at the fusion; a conditional's
    FLOPs are those of the branch kept for its bytes (the dearer one);
  - not counted: elementwise work (adds, exponentials, converts: XLA's model counts them, we compare matmuls
    against matmul-based useful counts), reductions, and custom calls (a Pallas kernel's FLOPs are not in the
    HLO: `custom_calls()` lists them by target with their executions).
Validated on XLA:CPU and XLA:TPU against hand counts (tests/test_hlo_bytes.py): a 5-step scan of matmuls
exactly; strided / padded / dilated / grouped convolutions exactly, and equal to cost_analysis there (no loop).

Why not `compiled.cost_analysis()["bytes accessed"]`: XLA's cost model counts each while-loop body once,
whatever its trip count, so for a decode loop around a layer scan its figure is neither a step nor a
program. Here loops are weighted by their trip counts and the outermost loop whose trip count is data
dependent (the sampler's decode loop) is reported per iteration: that is one decode step.

What is counted, per instruction executed (a leaf module: stdlib, re and numpy only):

- Bytes read + bytes written: each operand's bytes plus the output's (tuples summed), from the shapes in the
  text. Sizes are logical (elements x element size: pred/s8/u8/f8 1, bf16/f16/s16/u16 2, f32/s32/u32 4,
  f64/s64/u64/c64 8, c128 16, s4/u4 1/2); TPU tiled layouts such as `{1,0:T(8,128)(2,1)}` are read only for
  their memory space, their tile padding is not counted (a [64, 1] pred pads to whole tiles in HBM; the
  arrays that dominate a decode step tile without padding).
- Memory spaces: by default only HBM (memory space 0, no `S(n)` in the layout) counts. XLA:TPU places small
  buffers in VMEM (`S(1)`; SMEM/sync flags `S(2)`, `S(6)`) and moves them with copy-start / copy-done pairs;
  an operand read from VMEM moves no HBM bytes, while the prefetch that put it there read it from HBM once.
  `hbm_only=False` counts every memory space (logical bytes; what XLA:CPU, which has no memory spaces,
  gives either way).
- Free: parameter, constant, tuple, get-tuple-element, bitcast, after-all, partition-id, replica-id and the
  like (_FREE); `while` / `call` / `conditional` themselves (their operands are aliased): their computations
  count instead.
- Fusions count their own operands and outputs, not the instructions inside, except: an operand used inside
  (through bitcasts and nested fusions) only as the source of slice / dynamic-slice / gather counts what those
  read (their output size), and an output that is an in-place dynamic-update-slice or scatter into an
  operand (the fusion's root or a root tuple element, possibly inside a nested fusion) counts the update:
  the buffer operand is not read, the update region is written (and read too by a scatter whose combiner
  does not just overwrite). The update's own read is its operand's. Top-level slice / dynamic-slice /
  gather / dynamic-update-slice / scatter the same.
- Async pairs (copy-start/copy-done, all-gather-start/done, ...): the start reads its operands, the done
  writes its output; the tuple between them is not traffic. Generic async-start (calls=) counts its wrapped
  computation once.
- Custom calls (a Pallas kernel: custom_call_target="tpu_custom_call"): operands + outputs, unless the
  `custom_call` hook returns a figure (the paged-attention kernel is handed a layer's whole KV pool and reads
  only each row's live pages).
- while: body and condition weighted by the trip count: `trip_counts[name]` if given, else the
  backend_config's `known_trip_count` (XLA:CPU keeps it; XLA:TPU drops it from the loops it rewrites), else
  inferred from the loop's shape (condition `i < N` / `i <= N` / `i != N` / `>`, `>=` on a tuple element, that
  element started at a constant and stepped by a constant add in the body; N a constant or a loop-invariant
  element started at one), as XLA's own while-loop analysis does. A loop whose trip count stays unknown (a
  `lax.while_loop` on data) runs once in `total` and is listed in `loops`; the outermost one is the "step":
  `step` is one iteration of its body + condition, inner loops weighted. (The condition runs once more than
  the body; that extra evaluation is not counted.)
- call: its computation once; conditional: its most expensive branch (an upper bound on one execution).
  Reducers and comparators (to_apply of reduce, sort, scatter, ...) run inside their op: not counted. Sort
  counts one read and one write of its operands, whatever passes it makes.

Validation against XLA's cost model: `analyze(text, unit_trips=True, hbm_only=False)` (every loop once, every
memory space) against `cost_analysis()["bytes accessed"]`, which also counts each loop body once (measured
with jax 0.10.2 / libtpu 0.0.42.1, one v5p chip compiled without a TPU):
  - the 5-trip fori_loop of tests/test_hlo_bytes.py: XLA:CPU 3,244,077 vs 3,244,165 (-0.003%),
    XLA:TPU 3,244,165 vs 3,263,072 (-0.6%);
  - the sampler's decode program at Qwen3-0.6B shapes, batch 64, 768 tokens (benchmarks/decode_bytes.py),
    XLA:TPU: dense path -0.8%, paged path +0.5%;
  - the same program at --small shapes (batch 8, 128 tokens, vocab 2048): XLA:CPU -17% (dense and the paged
    gather path), XLA:TPU -34% (dense) and -40% (paged).
The small programs differ where XLA's model is known to charge differently, and we keep our rule:
  - XLA charges a fused gather or scatter for its whole operand; we charge what it touches (XLA:CPU, a
    take_along_axis picking one logit per row of [8, 2048] float32: 65,600 bytes vs our 96; one KV slot per
    row scattered into a [2, 8, 2, 128, 128] cache: 10.5 MB vs our 6.3 MB, the difference being the whole
    buffer read and written);
  - XLA:TPU charges an HBM -> VMEM prefetch (copy-start/copy-done) about 3x its size (a dynamic_slice of 16
    rows of a 4 MiB array XLA prefetches whole: 16.85 MB vs our 8.45 MB); we charge a read and a write.
At the real shapes the big arrays (weights, KV) dominate and are neither, so the two agree within 1%.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable, Iterable

import numpy as np

# Bytes per element. s4/u4 pack two to a byte.
DTYPE_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
               "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
               "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
               "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0, "opaque": 0}

# Instructions that move nothing themselves.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id",
         "replica-id", "add-dependency", "domain", "opt-barrier", "get-dimension-size", "set-dimension-size",
         "while", "call", "conditional", "async-update", "async-done"}
# Instructions that only move data (no arithmetic): their bytes are "copies" in the report.
# (An in-place dynamic-update-slice / scatter is not one: it writes new data.)
_MOVES = {"copy", "copy-start", "copy-done", "transpose", "reshape", "bitcast", "slice", "dynamic-slice",
          "concatenate", "pad", "broadcast", "parameter", "constant", "tuple", "get-tuple-element", "gather",
          "reverse"}
_SLICES = {"slice", "dynamic-slice", "gather"}
_ASYNC_DONE = re.compile(r"-done$")
_ASYNC_START = re.compile(r"-start$")

_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\](\{[^{}]*(?:\{[^{}]*\}[^{}]*)*\})?")
_SPACE = re.compile(r"S\((\d+)\)")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLED = re.compile(r",\s*(calls|to_apply|condition|body|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r",\s*(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_DIRECTION = re.compile(r"direction=([A-Z]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a shape: dtype, dims, logical bytes, memory space (0 = HBM / default)."""
    dtype: str
    dims: tuple
    nbytes: float
    space: int = 0


def parse_shape(text: str) -> list[Array]:
    """Every array in a (possibly tuple) shape string, in order; token[] and () give none."""
    out = []
    for m in _ARRAY.finditer(text):
        dt = m.group(1)
        if dt not in DTYPE_BYTES:
            continue
        dims = tuple(int(d.replace("<=", "")) for d in m.group(2).split(",") if d.strip())
        sp = _SPACE.search(m.group(3) or "")
        n = int(np.prod(dims, dtype=np.int64)) if dims else 1
        out.append(Array(dt, dims, n * DTYPE_BYTES[dt], int(sp.group(1)) if sp else 0))
    return out


@dataclasses.dataclass
class Instr:
    name: str
    shape_text: str
    opcode: str
    operands: list  # operand instruction names (literals for constant / parameter are in `literal`)
    attrs: str
    root: bool = False
    literal: str = ""

    @functools.cached_property
    def shape(self) -> list[Array]:
        return parse_shape(self.shape_text)

    @functools.cached_property
    def calls(self) -> dict:
        """Called computations by attribute (branch_computations as 'branch0', 'branch1', ...)."""
        out = {k: v for k, v in _CALLED.findall(self.attrs)}
        for m in _BRANCHES.finditer(self.attrs):
            for i, c in enumerate(x.strip().lstrip("%") for x in m.group(1).split(",") if x.strip()):
                out[f"branch{i}"] = c
        return out

    @property
    def target(self) -> str:
        m = _TARGET.search(self.attrs)
        return m.group(1) if m else ""

    @property
    def op_name(self) -> str:
        m = _OPNAME.search(self.attrs)
        return m.group(1) if m else ""


@dataclasses.dataclass
class Computation:
    name: str
    instrs: dict  # name -> Instr, in text order
    root: str
    entry: bool = False

    @functools.cached_property
    def params(self) -> dict:
        """parameter index -> instruction name."""
        return {int(i.literal): n for n, i in self.instrs.items() if i.opcode == "parameter"}

    @functools.cached_property
    def users(self) -> dict:
        u: dict = {}
        for i in self.instrs.values():
            for k, o in enumerate(i.operands):
                u.setdefault(o, []).append((i.name, k))
        return u


def _split_top(s: str) -> list[str]:
    """Split on commas outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur))
    return [x.strip() for x in out if x.strip()]


def _instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    # The shape: a balanced tuple "( ... )", or one token (its layout's parentheses sit inside braces).
    depth, i = 0, 0
    while i < len(rest):
        ch = rest[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            break
        i += 1
    shape_text, rest = rest[:i], rest[i:].lstrip()
    j = rest.find("(")
    if j < 0:
        return None
    opcode = rest[:j].strip()
    depth, k = 0, j
    while k < len(rest):
        if rest[k] == "(":
            depth += 1
        elif rest[k] == ")":
            depth -= 1
            if depth == 0:
                break
        k += 1
    inner, attrs = rest[j + 1:k], rest[k + 1:]
    operands, literal = [], ""
    if opcode in ("constant", "parameter"):
        literal = inner.strip()
    else:
        for part in _split_top(inner):
            toks = [t for t in part.split() if t.startswith("%")]
            if toks:
                operands.append(toks[-1][1:])
            elif re.fullmatch(r"[\w.\-]+", part.split()[-1]):  # names printed without '%'
                operands.append(part.split()[-1])
    return Instr(name, shape_text, opcode, operands, attrs, root, literal)


def parse(text: str) -> dict:
    """Computations of an HLO module's text, by name (the entry one has .entry set)."""
    comps: dict = {}
    cur = None
    for raw in text.splitlines():
        line = _COMMENT.sub("", raw)
        if cur is None:
            m = _HEADER.match(line)
            if m:
                cur = Computation(m.group(2), {}, "", bool(m.group(1)))
            continue
        if line.strip() == "}":
            if not cur.root and cur.instrs:
                cur.root = next(reversed(cur.instrs))
            comps[cur.name] = cur
            cur = None
            continue
        ins = _instr(line)
        if ins is not None:
            cur.instrs[ins.name] = ins
            if ins.root:
                cur.root = ins.name
    if not any(c.entry for c in comps.values()):
        raise ValueError("no ENTRY computation in this HLO text")
    return comps


# ---- trip counts ----

def _through(comp: Computation, name: str, ops=("bitcast",)) -> str:
    while comp.instrs[name].opcode in ops and comp.instrs[name].operands:
        name = comp.instrs[name].operands[0]
    return name


def _resolve(comps, comp: Computation, name: str, env: dict | None = None, depth: int = 0):
    """A scalar's value as an expression: an int (a constant), ('gte', k) (element k of the computation's
    tuple parameter), ('op', opcode, direction, [args]) or None (anything else). Looks through copies,
    converts, bitcasts and fusions that wrap one op (XLA:CPU wraps scalar adds and compares)."""
    if depth > 32 or name not in comp.instrs:
        return None
    i = comp.instrs[name]
    op = i.opcode
    if op == "constant":
        try:
            return int(i.literal)
        except ValueError:
            return {"true": 1, "false": 0}.get(i.literal)
    if op in ("copy", "bitcast", "convert", "reshape") and i.operands:
        return _resolve(comps, comp, i.operands[0], env, depth + 1)
    if op == "parameter":
        if env is not None:
            return env.get(int(i.literal))
        return ("param", int(i.literal))
    if op == "get-tuple-element":
        src = comp.instrs.get(i.operands[0])
        k = int(re.search(r"index=(\d+)", i.attrs).group(1))
        if src is not None and src.opcode == "parameter" and env is None:
            return ("gte", k)
        if src is not None and src.opcode == "tuple":
            return _resolve(comps, comp, src.operands[k], env, depth + 1)
        return None
    if op == "fusion":
        called = comps.get(i.calls.get("calls", ""))
        if called is None:
            return None
        inner_env = {k: _resolve(comps, comp, o, env, depth + 1) for k, o in enumerate(i.operands)}
        return _resolve(comps, called, called.root, inner_env, depth + 1)
    if op in ("add", "subtract", "compare", "multiply"):
        d = _DIRECTION.search(i.attrs)
        return ("op", op, d.group(1) if d else "", [_resolve(comps, comp, o, env, depth + 1) for o in i.operands])
    return None


def _trip_count(comps, caller: Computation, w: Instr) -> int | None:
    """A while loop's trip count from its condition, body and initial tuple (None when not of the form
    `i = c0; while i <op> N: i += s` with constants c0, N and s, N possibly a loop-invariant element)."""
    m = _TRIP.search(w.attrs)
    if m:
        return int(m.group(1))
    calls = w.calls
    cond, body = comps.get(calls.get("condition", "")), comps.get(calls.get("body", ""))
    if cond is None or body is None or not w.operands:
        return None
    init_t = caller.instrs.get(_through(caller, w.operands[0], ("bitcast", "copy")))
    body_root = body.instrs[body.root]

    def init(k):
        if init_t is None or init_t.opcode != "tuple" or k >= len(init_t.operands):
            return None
        v = _resolve(comps, caller, init_t.operands[k])
        return v if isinstance(v, int) else None

    def invariant(k):
        return body_root.opcode == "tuple" and k < len(body_root.operands) and \
            _resolve(comps, body, body_root.operands[k]) == ("gte", k)

    def value(x):  # a condition operand: a constant, or a loop-invariant element started at a constant
        if isinstance(x, int):
            return x
        if isinstance(x, tuple) and x[0] == "gte" and invariant(x[1]):
            return init(x[1])
        return None

    c = _resolve(comps, cond, cond.root)
    if not (isinstance(c, tuple) and c[0] == "op" and c[1] == "compare" and len(c[3]) == 2):
        return None
    d, (a, b) = c[2], c[3]
    flip = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE", "NE": "NE", "EQ": "EQ"}
    if not (isinstance(a, tuple) and a[0] == "gte" and not invariant(a[1])):
        a, b, d = b, a, flip.get(d, d)
    if not (isinstance(a, tuple) and a[0] == "gte"):
        return None
    k, n, i0 = a[1], value(b), init(a[1])
    if n is None or i0 is None or body_root.opcode != "tuple" or k >= len(body_root.operands):
        return None
    s = _resolve(comps, body, body_root.operands[k])
    if not (isinstance(s, tuple) and s[0] == "op" and s[1] in ("add", "subtract") and len(s[3]) == 2):
        return None
    x, y = s[3]
    if s[1] == "add" and x != ("gte", k):
        x, y = y, x
    if x != ("gte", k) or not isinstance(y, int) or y == 0:
        return None
    step = y if s[1] == "add" else -y
    if d == "LT" and step > 0:
        return max(0, -(-(n - i0) // step))
    if d == "LE" and step > 0:
        return max(0, (n - i0) // step + 1)
    if d == "GT" and step < 0:
        return max(0, -(-(i0 - n) // -step))
    if d == "GE" and step < 0:
        return max(0, (i0 - n) // -step + 1)
    if d == "NE" and (n - i0) % step == 0 and (n - i0) // step >= 0:
        return (n - i0) // step
    return None


# ---- bytes of one instruction ----

@dataclasses.dataclass
class Record:
    """One instruction as counted: bytes per execution, executions per program run (`weight`; loops of
    unknown trip count weigh 1), whether it lies in the step loop (and its weight per step)."""
    name: str
    opcode: str
    computation: str
    shape: str
    bytes: float
    weight: float
    step_weight: float = 0.0  # executions per step (0: outside the step loop)
    copy: bool = False
    op_name: str = ""
    flops: float = 0.0  # matmul FLOPs per execution (dot / convolution, those inside a fusion included)
    target: str = ""  # a custom call's target

    @property
    def total(self) -> float:
        return self.bytes * self.weight


def _sum(arrays: Iterable[Array], hbm_only: bool) -> float:
    return float(sum(a.nbytes for a in arrays if not hbm_only or a.space == 0))


def _overwrites(comps, ins: Instr) -> bool:
    """A scatter whose combiner returns the update (a set, not an add)."""
    c = comps.get(ins.calls.get("to_apply", ""))
    if c is None:
        return False
    r = c.instrs[c.root]
    return r.opcode == "parameter" and int(r.literal) == 1


def _uses(comp: Computation, name: str) -> list:
    """(user, operand index) of an instruction, looking through bitcasts; ("", -1) when it is (a bitcast of)
    the computation's root: its whole value leaves the computation."""
    res = [("", -1)] if name == comp.root else []
    for u, k in comp.users.get(name, []):
        if comp.instrs[u].opcode == "bitcast":
            res += _uses(comp, u)
        else:
            res.append((u, k))
    return res


def _in_place(comps, fc: Computation, name: str, depth: int = 0):
    """If `name` (through bitcasts) is a dynamic-update-slice / scatter into a parameter of fc, directly or
    through nested fusions: (parameter name, update bytes, region bytes read, {(computation, instr)} of the
    update ops). None otherwise."""
    i = fc.instrs[_through(fc, name)]
    if i.opcode in ("dynamic-update-slice", "scatter") and len(i.operands) >= 2:
        buf = fc.instrs[_through(fc, i.operands[0])]
        if buf.opcode != "parameter":
            return None
        n = (len(i.operands) - 1) // 2 if i.opcode == "scatter" else 1
        upd = sum(_sum(fc.instrs[u].shape, False) for u in i.operands[n + 1:]) if i.opcode == "scatter" \
            else _sum(fc.instrs[i.operands[1]].shape, False)
        read = upd if i.opcode == "scatter" and not _overwrites(comps, i) else 0.0
        return buf.name, upd, read, {(fc.name, i.name)}
    if i.opcode == "fusion" and depth < 8:
        nc = comps.get(i.calls.get("calls", ""))
        got = _in_place(comps, nc, nc.root, depth + 1) if nc is not None else None
        if got is not None:
            k = int(nc.instrs[got[0]].literal)
            outer = fc.instrs[_through(fc, i.operands[k])] if k < len(i.operands) else None
            if outer is not None and outer.opcode == "parameter":
                return outer.name, got[1], got[2], got[3]
    return None


def _param_read(comps, fc: Computation, pname: str, in_place: dict, depth: int = 0):
    """Bytes a fusion reads of its parameter `pname` when that is less than the whole operand (None: the
    whole). Slices, dynamic slices and gathers read their output's bytes; an in-place update's buffer is not
    read (a combining scatter reads its region); nested fusions are followed to their own parameters."""
    total = 0.0
    for u, k in _uses(fc, pname):
        if k < 0:
            return None
        ui = fc.instrs[u]
        if ui.opcode in _SLICES and k == 0:
            total += _sum(ui.shape, False)
        elif k == 0 and (fc.name, u) in in_place:
            total += in_place[(fc.name, u)]
        elif ui.opcode == "fusion" and depth < 8 and ui.calls.get("calls") in comps:
            nc = comps[ui.calls["calls"]]
            inner = nc.params.get(k)
            r = None if inner is None else _param_read(comps, nc, inner, in_place, depth + 1)
            if r is None:
                return None
            total += r
        else:
            return None
    return total


def _fusion_bytes(comps, caller: Computation, ins: Instr, hbm_only: bool) -> tuple[float, bool]:
    """(bytes, moves-only) of a fusion under the rules in the module docstring."""
    fc = comps.get(ins.calls.get("calls", ""))
    if fc is None:
        return _generic(caller, ins, hbm_only), False
    root = fc.instrs[_through(fc, fc.root)]
    outs = [_through(fc, o) for o in root.operands] if root.opcode == "tuple" else [root.name]
    out_arrays = ins.shape
    updates, in_place = {}, {}  # output index -> update bytes; (computation, op) -> region bytes read
    for j, o in enumerate(outs):
        got = _in_place(comps, fc, o)
        if got is not None:
            updates[j] = got[1]
            in_place.update({key: got[2] for key in got[3]})
    total = 0.0
    for p, pname in fc.params.items():
        if p >= len(ins.operands):
            continue
        arrs = caller.instrs[ins.operands[p]].shape if ins.operands[p] in caller.instrs else []
        if hbm_only and all(a.space != 0 for a in arrs):
            continue
        part = _param_read(comps, fc, pname, in_place)
        total += _sum(arrs, hbm_only) if part is None else part
    for j in range(len(outs)):
        if j >= len(out_arrays):
            break
        arrs = [out_arrays[j]] if root.opcode == "tuple" else out_arrays
        if hbm_only and all(x.space != 0 for x in arrs):
            continue
        total += updates[j] if j in updates else _sum(arrs, hbm_only)
    moves = all(x.opcode in _MOVES for x in fc.instrs.values())
    return total, moves


def _operand_arrays(caller: Computation, ins: Instr) -> list[list[Array]]:
    return [caller.instrs[o].shape if o in caller.instrs else [] for o in ins.operands]


def _generic(caller: Computation, ins: Instr, hbm_only: bool) -> float:
    return sum(_sum(a, hbm_only) for a in _operand_arrays(caller, ins)) + _sum(ins.shape, hbm_only)


def _instr_bytes(comps, caller: Computation, ins: Instr, hbm_only: bool, custom_call) -> tuple[float, bool]:
    op = ins.opcode
    if op in _FREE:
        return 0.0, op in _MOVES
    ops = _operand_arrays(caller, ins)
    if op == "fusion":
        return _fusion_bytes(comps, caller, ins, hbm_only)
    if op == "custom-call" and custom_call is not None:
        got = custom_call(ins, ops)
        if got is not None:
            return float(got), False
    if op in _SLICES:  # reads what it returns (plus its indices)
        out = _sum(ins.shape, hbm_only)
        idx = sum(_sum(a, hbm_only) for a in ops[1:])
        src = ops[0] if ops else []
        read = _sum(ins.shape, False) if not hbm_only or any(a.space == 0 for a in src) else 0.0
        return out + read + idx, True
    if op == "dynamic-update-slice":  # in place: reads the update, writes it
        upd = _sum(ops[1], hbm_only) if len(ops) > 1 else 0.0
        dst = _sum(ops[1], False) if not hbm_only or any(a.space == 0 for a in ins.shape) else 0.0
        return upd + dst + sum(_sum(a, hbm_only) for a in ops[2:]), True
    if op == "scatter":  # in place: reads indices and updates, writes the updated region
        n = (len(ops) - 1) // 2  # variadic scatter: n buffers, indices, n updates
        upd = sum(_sum(a, hbm_only) for a in ops[n:])
        region = sum(_sum(a, False) for a in ops[n + 1:])
        dst = region if not hbm_only or any(a.space == 0 for a in ins.shape) else 0.0
        return upd + dst * (1 if _overwrites(comps, ins) else 2), False
    if op == "async-start":
        return 0.0, False  # its wrapped computation is counted by the walk
    if _ASYNC_START.search(op):  # copy-start, all-gather-start, ...: the reads
        return sum(_sum(a, hbm_only) for a in ops), op == "copy-start"
    if _ASYNC_DONE.search(op):  # ... -done: the write
        return _sum(ins.shape, hbm_only), op == "copy-done"
    return _generic(caller, ins, hbm_only), op in _MOVES


# ---- matmul FLOPs of one instruction ----

_DOT_DIMS = re.compile(r"\b(lhs_contracting_dims)=\{([\d,\s]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_GROUPS = re.compile(r"\b(feature_group_count|batch_group_count)=(\d+)")


def _operand_dims(comp: Computation, ins: Instr, k: int) -> tuple | None:
    o = comp.instrs.get(ins.operands[k]) if k < len(ins.operands) else None
    arrs = o.shape if o is not None else []
    return arrs[0].dims if arrs else None


def dot_flops(comp: Computation, ins: Instr) -> float:
    """2 x output elements x contracted size (the product of the lhs contracting dimensions)."""
    out, lhs = ins.shape, _operand_dims(comp, ins, 0)
    m = _DOT_DIMS.search(ins.attrs)
    if not out or lhs is None:
        return 0.0
    k = math.prod(lhs[int(d)] for d in m.group(2).split(",") if d.strip()) if m else 1
    return 2.0 * math.prod(out[0].dims) * k


def _window(attrs: str, n: int) -> list[dict]:
    """The window's per-spatial-dimension size, stride, padding and dilations (XLA's defaults where absent)."""
    dims = [dict(size=None, stride=1, lo=0, hi=0, lhs_dilate=1, rhs_dilate=1) for _ in range(n)]
    m = _WINDOW.search(attrs)
    for item in (m.group(1).split() if m else []):
        key, _, val = item.partition("=")
        parts = val.split("x")
        if len(parts) != n:
            continue
        for d, v in zip(dims, parts):
            if key == "pad":
                lo, _, hi = v.partition("_")
                d["lo"], d["hi"] = int(lo), int(hi)
            elif key in ("size", "stride", "lhs_dilate", "rhs_dilate"):
                d[key] = int(v)
    return dims


def _valid_positions(I: int, K: int, O: int, w: dict) -> int:
    """(output index, kernel index) pairs of one spatial dimension that land on an input element: in bounds
    and, under lhs (base) dilation, not on a hole. XLA's HloCostAnalysis counts the same pairs."""
    s, lo, ld, rd = w["stride"], w["lo"], w["lhs_dilate"], w["rhs_dilate"]
    k = np.arange(K, dtype=np.int64)
    if ld == 1:  # for each kernel index, the outputs whose input index o * s - lo + k * rd lies in [0, I)
        c = k * rd - lo
        first = np.maximum(0, -(c // s))  # the smallest o with o * s + c >= 0: ceil(-c / s)
        last = np.minimum(O - 1, (I - 1 - c) // s)  # the largest with o * s + c <= I - 1
        return int(np.maximum(0, last - first + 1).sum())
    total = 0
    o = np.arange(O, dtype=np.int64)
    for kk in range(K):  # lhs dilation (transposed convolutions): rare in matmul programs, counted directly
        u = o * s - lo + kk * rd
        total += int(np.count_nonzero((u >= 0) & (u % ld == 0) & (u // ld < I)))
    return total


def convolution_flops(comp: Computation, ins: Instr) -> float:
    """2 x (input features / feature groups) x output features x (input batch / batch groups) x the valid
    (output, kernel) position pairs of each spatial dimension: XLA's HloCostAnalysis rule. For a matmul that
    XLA:TPU writes as a convolution (dim_labels=bf_io->bf, no window) that is 2 x output elements x the
    kernel's input-feature size, the contracted size."""
    m = _DIM_LABELS.search(ins.attrs)
    lhs, rhs = _operand_dims(comp, ins, 0), _operand_dims(comp, ins, 1)
    if m is None or lhs is None or rhs is None or not ins.shape:
        return 0.0
    ll, rl, ol = m.groups()
    out = ins.shape[0].dims
    if len(ll) != len(lhs) or len(rl) != len(rhs) or len(ol) != len(out):
        return 0.0
    groups = {k: int(v) for k, v in _GROUPS.findall(ins.attrs)}
    n = len(ll) - 2
    wins = _window(ins.attrs, n)
    valid = 1
    for j in range(n):
        d = str(j)
        I, K, O = lhs[ll.index(d)], rhs[rl.index(d)], out[ol.index(d)]
        valid *= _valid_positions(I, wins[j]["size"] or K, O, wins[j])
    fma = (lhs[ll.index("f")] // groups.get("feature_group_count", 1)) * out[ol.index("f")] * \
        (lhs[ll.index("b")] // groups.get("batch_group_count", 1)) * valid
    return 2.0 * fma


def _comp_flops(comps, name: str, memo: dict) -> float:
    """Matmul FLOPs of one run of a fused (or fusion-called) computation, nested fusions and calls included."""
    if name not in memo:
        memo[name] = 0.0  # guards the recursion; HLO has no cycles
        fc = comps.get(name)
        memo[name] = 0.0 if fc is None else sum(_instr_flops(comps, fc, i, memo, inside=True)
                                                for i in fc.instrs.values())
    return memo[name]


def _instr_flops(comps, comp: Computation, ins: Instr, memo: dict, inside: bool = False) -> float:
    """Matmul FLOPs of one execution of an instruction: a dot or convolution, or every one inside a fusion.
    Loops, calls and conditionals of a walked computation count through the walk instead (weighted); a call
    inside a fusion (not walked) is folded in here."""
    op = ins.opcode
    if op == "dot":
        return dot_flops(comp, ins)
    if op == "convolution":
        return convolution_flops(comp, ins)
    if op == "fusion":
        return _comp_flops(comps, ins.calls.get("calls", ""), memo)
    if op == "call" and inside:
        return _comp_flops(comps, ins.calls.get("to_apply", ""), memo)
    return 0.0


# ---- the walk ----

@dataclasses.dataclass
class Loop:
    name: str
    computation: str
    trips: int | None
    source: str  # "given" | "backend_config" | "inferred" | "unknown" | "unit"
    weight: float  # executions of the while instruction per program run
    per_iteration: float = 0.0  # bytes of one iteration of body + condition (inner loops weighted)
    depth: int = 0


@dataclasses.dataclass
class Report:
    total: float  # the entry computation run once (loops of unknown trip count: one iteration)
    step: float | None  # one iteration of the step loop (None: no loop of unknown trip count)
    step_loop: str | None
    records: list
    loops: list
    hbm_only: bool = True

    def _scope(self, scope: str):
        if scope == "step":
            return [(r, r.step_weight) for r in self.records if r.step_weight]
        return [(r, r.weight) for r in self.records]

    def by_opcode(self, scope: str = "step") -> dict:
        """Bytes by opcode (fusions as 'fusion'), largest first."""
        out: dict = {}
        for r, w in self._scope(scope):
            out[r.opcode] = out.get(r.opcode, 0.0) + r.bytes * w
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def top(self, n: int = 10, scope: str = "step") -> list:
        """The n instructions moving the most bytes: (record, bytes per scope, weight)."""
        rows = [(r, r.bytes * w, w) for r, w in self._scope(scope) if r.bytes]
        return sorted(rows, key=lambda x: -x[1])[:n]

    @property
    def flops(self) -> float:
        """Matmul FLOPs of the program run once (loops weighted by their trip counts; unknown ones once)."""
        return float(sum(r.flops * r.weight for r in self.records))

    @property
    def step_flops(self) -> float | None:
        """Matmul FLOPs of one iteration of the step loop (None: no loop of unknown trip count)."""
        return None if self.step is None else float(sum(r.flops * r.step_weight for r in self.records))

    def matmuls(self, n: int = 10, scope: str = "total") -> list:
        """The n instructions (dots, convolutions, fusions holding them) with the most matmul FLOPs:
        (record, FLOPs per scope, weight)."""
        rows = [(r, r.flops * w, w) for r, w in self._scope(scope) if r.flops]
        return sorted(rows, key=lambda x: -x[1])[:n]

    def custom_calls(self) -> dict:
        """Custom calls by target (executions per program run): their FLOPs (a Pallas kernel's) are not seen."""
        out: dict = {}
        for r in self.records:
            if r.opcode == "custom-call":
                out[r.target] = out.get(r.target, 0.0) + r.weight
        return out

    def copy_bytes(self, scope: str = "step") -> float:
        """Bytes of pure data movement: copy / transpose / copy-start/done, and fusions of moves only."""
        return sum(r.bytes * w for r, w in self._scope(scope) if r.copy)

    def format(self, n: int = 10, scope: str = "step") -> str:
        G = 1e9
        val = self.step if scope == "step" else self.total
        lines = [f"{scope}: {0 if val is None else val / G:.4f} GB ({'HBM' if self.hbm_only else 'all memory spaces'})"
                 f", copies {self.copy_bytes(scope) / G:.4f} GB"]
        lines.append("  by opcode: " + ", ".join(f"{k} {v / G:.4f}" for k, v in list(self.by_opcode(scope).items())[:8]))
        for r, b, w in self.top(n, scope):
            lines.append(f"  {b / G:9.4f} GB  {r.opcode:<14} x{w:<6g} {r.name} {r.shape[:80]}  {r.op_name[-70:]}")
        for lp in self.loops:
            lines.append(f"  loop {lp.name}: trips {lp.trips} ({lp.source}), {lp.per_iteration / G:.4f} GB/iteration")
        return "\n".join(lines)


def analyze(hlo, *, trip_counts: dict | None = None, custom_call: Callable | None = None, hbm_only: bool = True,
            unit_trips: bool = False) -> Report:
    """Count the bytes of an optimized HLO module (text, or parse()'s result). trip_counts: while name ->
    trips (overrides everything else); custom_call(instr, operand arrays) -> bytes or None (default: operands
    + outputs); unit_trips: every loop weighs 1 (to compare with cost_analysis)."""
    comps = parse(hlo) if isinstance(hlo, str) else hlo
    entry = next(c for c in comps.values() if c.entry)
    trip_counts = trip_counts or {}

    memo: dict = {}  # fused computation -> matmul FLOPs of one run

    def run(step_name):
        records: list = []
        loops: list = []

        def walk(comp: Computation, weight: float, step_w: float, depth: int) -> float:
            total = 0.0
            for ins in comp.instrs.values():
                b, mv = _instr_bytes(comps, comp, ins, hbm_only, custom_call)
                shape = ins.shape_text if len(ins.shape_text) < 200 else ins.shape_text[:200] + "..."
                records.append(Record(ins.name, ins.opcode, comp.name, shape, b, weight, step_w, mv, ins.op_name,
                                      _instr_flops(comps, comp, ins, memo),
                                      ins.target if ins.opcode == "custom-call" else ""))
                total += b
                calls = ins.calls
                if ins.opcode == "while":
                    if unit_trips:
                        trips, src = 1, "unit"
                    elif ins.name in trip_counts:
                        trips, src = int(trip_counts[ins.name]), "given"
                    else:
                        trips = _trip_count(comps, comp, ins)
                        src = "unknown" if trips is None else (
                            "backend_config" if _TRIP.search(ins.attrs) else "inferred")
                    lp = Loop(ins.name, comp.name, trips, src, weight, depth=depth)
                    loops.append(lp)
                    k = 1 if trips is None else trips
                    inner = step_w * k
                    if ins.name == step_name:  # one iteration of this loop is the step
                        inner, lp.source = 1.0, "unknown (step)"
                    lp.per_iteration = sum(walk(comps[calls[c]], weight * k, inner, depth + 1)
                                           for c in ("body", "condition") if calls.get(c) in comps)
                    total += lp.per_iteration * k
                elif ins.opcode == "call" and calls.get("to_apply") in comps:
                    total += walk(comps[calls["to_apply"]], weight, step_w, depth)
                elif ins.opcode == "async-start" and calls.get("calls") in comps:
                    total += walk(comps[calls["calls"]], weight, step_w, depth)
                elif ins.opcode == "conditional":
                    branches = [comps[v] for k, v in sorted(calls.items()) if
                                (k.startswith("branch") or k.endswith("_computation")) and v in comps]
                    if branches:  # the most expensive branch: walk each, keep the records of the largest
                        n0, nl, costs = len(records), len(loops), []
                        for br in branches:
                            a, al = len(records), len(loops)
                            costs.append((walk(br, weight, step_w, depth), records[a:], loops[al:]))
                            del records[a:], loops[al:]
                        best = max(costs, key=lambda c: c[0])
                        records[n0:], loops[nl:] = best[1], best[2]
                        total += best[0]
            return total

        return walk(entry, 1.0, 0.0, 0), records, loops

    total, records, loops = run(None)
    unknown = [lp for lp in loops if lp.trips is None]
    if not unknown or unit_trips:
        return Report(total, None, None, records, loops, hbm_only)
    # The step: the outermost loop of unknown trip count (the largest per iteration among equals).
    first = min(unknown, key=lambda lp: (lp.depth, -lp.per_iteration))
    total, records, loops = run(first.name)
    step = sum(r.bytes * r.step_weight for r in records if r.step_weight)
    return Report(total, step, first.name, records, loops, hbm_only)


def cost_analysis_bytes(compiled) -> float:
    """XLA's own 'bytes accessed' of a compiled program (each loop body counted once)."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    return float(ca.get("bytes accessed", math.nan))


def cost_analysis_flops(compiled) -> float:
    """XLA's own 'flops' of a compiled program: each loop body counted once, elementwise work included."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    return float(ca.get("flops", math.nan))
