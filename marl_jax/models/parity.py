"""Check marl_jax against transformers' PyTorch model on one checkpoint folder.

    python -m marl_jax.models.parity --hf_dir=DIR [--batch=4 --length=32 --atol=1e-4]

Runs the same random token batch (with some left padding) through both, prints the max absolute
logit difference, the mean KL(HF || marl_jax) of next-token distributions and the greedy-token
agreement, and exits 1 past tolerance. Needs torch (`pip install torch==2.13.0`); the rest of
marl_jax does not.
"""
from __future__ import annotations

import dataclasses
import sys

import numpy as np


@dataclasses.dataclass
class ParityReport:
    max_abs_diff: float
    mean_kl: float
    greedy_agreement: float

    def ok(self, atol: float, min_agreement: float = 1.0) -> bool:
        return self.max_abs_diff <= atol and self.greedy_agreement >= min_agreement


def compare_logits(ref: np.ndarray, ours: np.ndarray, valid: np.ndarray) -> ParityReport:
    """ref, ours: [B, T, V] logits; valid: [B, T] positions to compare."""
    ref, ours = ref[valid].astype(np.float64), ours[valid].astype(np.float64)
    lp_ref = ref - np.logaddexp.reduce(ref, axis=-1, keepdims=True)
    lp_ours = ours - np.logaddexp.reduce(ours, axis=-1, keepdims=True)
    kl = np.sum(np.exp(lp_ref) * (lp_ref - lp_ours), axis=-1)
    agree = np.mean(np.argmax(ref, -1) == np.argmax(ours, -1))
    return ParityReport(float(np.abs(ref - ours).max()), float(kl.mean()), float(agree))


def run_parity(hf_dir: str, *, batch: int = 4, length: int = 32, seed: int = 0) -> ParityReport:
    try:
        import torch
        import transformers
    except ImportError as e:  # the library itself never needs torch
        raise SystemExit(f"parity needs torch and transformers: pip install torch==2.13.0 transformers ({e})")
    import jax.numpy as jnp

    from marl_jax.models import decoder, hf

    cfg, params = hf.load_hf_dir(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, cfg.vocab_size, (batch, length))
    valid = np.ones((batch, length), bool)
    for b in range(1, batch):  # left padding of different amounts
        valid[b, : rng.randint(0, length // 2)] = False
    with torch.no_grad():
        ref = model(torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(np.int64))).logits.float().numpy()
    ours = np.asarray(decoder.forward(params, cfg, jnp.asarray(tokens), jnp.asarray(valid)))
    return compare_logits(ref, ours, valid)


def main(argv=None):
    from absl import flags

    flags.DEFINE_string("hf_dir", None, "Hugging Face checkpoint folder.", required=True)
    flags.DEFINE_integer("batch", 4, "Rows.")
    flags.DEFINE_integer("length", 32, "Tokens per row.")
    flags.DEFINE_float("atol", 1e-4, "Max absolute logit difference allowed.")
    flags.DEFINE_integer("seed", 0, "Seed of the random batch.")

    def _main(argv):
        F = flags.FLAGS
        r = run_parity(F.hf_dir, batch=F.batch, length=F.length, seed=F.seed)
        print(f"max_abs_logit_diff={r.max_abs_diff:.3e}")
        print(f"mean_kl={r.mean_kl:.3e}")
        print(f"greedy_agreement={r.greedy_agreement:.4f}")
        ok = r.ok(F.atol)
        print("PASS" if ok else f"FAIL (atol {F.atol}, greedy agreement must be 1.0)")
        sys.exit(0 if ok else 1)

    from marl_jax.cli import run

    run(_main, "marl_jax.models.parity", argv)


if __name__ == "__main__":
    main()
