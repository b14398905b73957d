"""Writes a synthetic multi-site clinical table shaped like the UCI Heart Disease data.

Every value is made up by a seeded random generator: no patient is behind any row. The file
has the shape real multi-site tabular data has, so that the CSV loader can be exercised on it
(see docs/guide/data.md):

- four hospitals in a ``site`` column: cleveland, hungarian, switzerland, va (303, 294, 123
  and 200 rows by default, 920 in all);
- the 13 features of the UCI table under their usual names; ``sex``, ``cp``, ``restecg``,
  ``exang``, ``slope`` and ``thal`` are written as text (``male``, ``asymptomatic``, ...);
- the label ``num`` in 0..4 (0: no disease; 1-4: disease of growing severity);
- per-site shifts: each site has its own disease rate (as in the real data, Switzerland's is
  far higher than Hungary's), age, sex ratio and blood-pressure level;
- site-specific gaps, each site with its own marker (``?``, empty, ``NA``, ``nan``): most of
  Switzerland's cholesterol, most of ``ca`` and ``thal`` outside Cleveland, ``slope`` at
  Hungary and VA, a few scattered ones elsewhere.

Features are drawn given the disease status (a class-conditional generator), so a model can
learn the label, and sites differ in both their features and their label rates.

    python experiments/make_heart_like_csv.py --out heart.csv            # 920 rows, seed 0
    python experiments/make_heart_like_csv.py --out small.csv --rows 120 --seed 3
    fedkernels run --data.name csv --data.path heart.csv --data.label_column num \\
        --data.positive_labels 1,2,3,4 --data.client_column site --partition.kind natural
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np

SITES = {  # rows at the default size, disease rate, mean age, share of men, blood-pressure shift
    "cleveland": (303, 0.46, 54.0, 0.68, 0.0),
    "hungarian": (294, 0.36, 48.0, 0.72, -2.0),
    "switzerland": (123, 0.93, 55.0, 0.92, -3.0),
    "va": (200, 0.75, 59.0, 0.97, 6.0),
}
# each site's marker for a missing value, and the chance that a column is missing there
MISSING = {
    "cleveland": ("?", {"ca": 0.02, "thal": 0.01}),
    "hungarian": ("?", {"ca": 0.95, "thal": 0.85, "slope": 0.6, "chol": 0.08, "fbs": 0.03}),
    "switzerland": ("", {"chol": 0.9, "ca": 0.95, "thal": 0.4, "fbs": 0.6, "trestbps": 0.02}),
    "va": ("NA", {"ca": 0.98, "thal": 0.8, "slope": 0.5, "trestbps": 0.3, "fbs": 0.05,
                  "thalach": 0.25, "exang": 0.25, "oldpeak": 0.25, "chol": 0.03}),
}
COLUMNS = ["age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalach", "exang",
           "oldpeak", "slope", "ca", "thal", "num", "site"]
CHEST_PAIN = ["typical angina", "atypical angina", "non-anginal pain", "asymptomatic"]
RESTING_ECG = ["normal", "st-t abnormality", "lv hypertrophy"]
SLOPE = ["upsloping", "flat", "downsloping"]
THAL = ["normal", "fixed defect", "reversible defect"]


def site_rows(site: str, count: int, rng: np.random.Generator) -> list[dict[str, object]]:
    """``count`` synthetic rows of one site."""
    _, rate, mean_age, male, bp_shift = SITES[site]
    marker, gaps = MISSING[site]
    rows = []
    for _ in range(count):
        sick = rng.random() < rate
        d = 1.0 if sick else 0.0
        age = int(np.clip(rng.normal(mean_age + 3 * d, 8.5), 28, 77))
        row: dict[str, object] = {
            "age": age,
            "sex": "male" if rng.random() < min(male + 0.08 * d, 0.99) else "female",
            "cp": CHEST_PAIN[rng.choice(4, p=[0.08, 0.12, 0.25, 0.55] if sick
                                         else [0.1, 0.3, 0.4, 0.2])],
            "trestbps": int(np.clip(rng.normal(130 + bp_shift + 4 * d, 17), 90, 200)),
            "chol": int(np.clip(rng.normal(240 + 10 * d, 50), 120, 560)),
            "fbs": int(rng.random() < 0.15 + 0.05 * d),
            "restecg": RESTING_ECG[rng.choice(3, p=[0.55, 0.2, 0.25] if sick
                                              else [0.65, 0.12, 0.23])],
            "thalach": int(np.clip(rng.normal(155 - 0.6 * (age - 54) - 18 * d, 19), 70, 202)),
            "exang": "yes" if rng.random() < (0.55 if sick else 0.15) else "no",
            "oldpeak": round(float(max(0.0, rng.gamma(1.2 + 1.3 * d, 0.7) - 0.3)), 1),
            "slope": SLOPE[rng.choice(3, p=[0.25, 0.65, 0.1] if sick else [0.65, 0.3, 0.05])],
            "ca": int(rng.choice(4, p=[0.35, 0.3, 0.2, 0.15] if sick
                                 else [0.8, 0.12, 0.05, 0.03])),
            "thal": THAL[rng.choice(3, p=[0.25, 0.1, 0.65] if sick else [0.8, 0.05, 0.15])],
            "num": int(rng.choice([1, 2, 3, 4], p=[0.4, 0.25, 0.25, 0.1])) if sick else 0,
            "site": site,
        }
        for column, chance in gaps.items():
            if rng.random() < chance:
                row[column] = marker
        if site == "cleveland" and rng.random() < 0.01:
            row["chol"] = "nan"  # one more spelling of a gap
        rows.append(row)
    return rows


def make_heart_like(rows: int = 920, seed: int = 0) -> list[dict[str, object]]:
    """About ``rows`` rows (each site keeps its share, at least 8), shuffled."""
    rng = np.random.default_rng(seed)
    total = sum(size for size, *_ in SITES.values())
    table = []
    for site, (size, *_) in SITES.items():
        table += site_rows(site, max(8, round(rows * size / total)), rng)
    return [table[i] for i in rng.permutation(len(table))]


def write_heart_like_csv(path: str | Path, rows: int = 920, seed: int = 0) -> Path:
    path = Path(path)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(make_heart_like(rows, seed))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="heart_like_synthetic.csv", help="file to write")
    parser.add_argument("--rows", type=int, default=920, help="about this many rows")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generator")
    args = parser.parse_args()
    if args.rows < 32:
        parser.error("--rows must be >= 32 (8 per site)")
    path = write_heart_like_csv(args.out, args.rows, args.seed)
    print(f"wrote {path} (synthetic, seed {args.seed})")


if __name__ == "__main__":
    main()
