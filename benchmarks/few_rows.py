"""The decoder's 5-row products, float against integer, on this CPU, in the same run.

    python benchmarks/few_rows.py                 # the full architecture's harness model
    python benchmarks/few_rows.py --rounds 5

A 5-beam decoder step multiplies five rows by each 2-bit layer matrix (q, k, v and the gate
stacked: 1120 x 512) and by the 4-bit head. The engine gives the decoder's few rows the integer
products only on the VNNI path (`blocks.integer_products_run(decoder=True)`): there `_tile_codes`
expands the codes in registers with vpermw. This times, on whatever CPU runs it, the float products
the decoder holds elsewhere against the integer products' path this CPU has (on AVX2: vpmaddwd,
each column block's codes expanded by compare-and-select into a scratch the rows then read), both
built from the same matrices, with their outputs compared. Prints the medians (us) and the
ratio integer / float per round; below 1 the integer products would be faster here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from whistle_stream import blocks as B  # noqa: E402
from whistle_stream.container import CactFile  # noqa: E402
from whistle_stream.decoder import _LevelsLinear  # noqa: E402
from whistle_stream.kernels import integer as KI  # noqa: E402

MATRICES = {"q, k, v, gate (2-bit)": ("layer00.q_proj", "layer00.k_proj", "layer00.v_proj", "layer00.gate_proj"),
            "head (4-bit)": ("embedding",)}


def both_forms(cact: CactFile, names: tuple[str, ...]) -> tuple[_LevelsLinear, _LevelsLinear]:
    """The matrix as the decoder holds it here, and in the integer products' form (this CPU's path)."""
    held = _LevelsLinear(cact, *names)
    saved = B.integer_products_run
    B.integer_products_run = lambda decoder=False: KI.AVAILABLE   # the many-row rule for few rows too
    try:
        integer = _LevelsLinear(cact, *names)
    finally:
        B.integer_products_run = saved
    return held, integer


def median_us(layer: _LevelsLinear, x: np.ndarray, calls: int) -> float:
    times = []
    for _ in range(calls):
        h = x.copy()
        t0 = time.perf_counter()
        layer.quantised(h)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a .cact (default: the harness's full architecture)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    if not KI.AVAILABLE:
        print(f"this CPU has no integer products ({B.kernel_path()}): nothing to compare")
        return 0
    if args.model is None:
        from harness import reference
        args.model = reference.build_model("full").path
    cact = CactFile(args.model)
    print(f"kernels: {B.kernel_path()}; integer path {KI.PATH}; 5 rows")
    rng = np.random.default_rng(0)
    for label, names in MATRICES.items():
        held, integer = both_forms(cact, names)
        if integer.integer is None:
            print(f"{label}: its codebook is off the integer grid: the float products only")
            continue
        x = rng.standard_normal((5, held.shape[1])).astype(np.float32)
        a, b = held.quantised(x.copy()), integer.quantised(x.copy())
        what = "integer" if held.integer is not None else "float"
        print(f"{label} {held.shape[0]} x {held.shape[1]}: held {what}; outputs within "
              f"{np.abs(a - b).max() / np.abs(a).max():.1e} (relative)")
        for r in range(args.rounds):
            t_held, t_int = median_us(held, x, args.calls), median_us(integer, x, args.calls)
            print(f"  round {r + 1}: held {t_held:.0f} us, integer path {t_int:.0f} us, ratio {t_int / t_held:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
