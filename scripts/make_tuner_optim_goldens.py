#!/usr/bin/env python3
"""Golden Adafactor updates from MLX's own optimizer, for rmlx-lm's tuner tests.

Writes ``crates/rmlx-lm/tests/fixtures/tuner/optim_goldens.json``: fixed parameters (a 2-D and a
3-D one, whose second moments MLX factors into rows and columns, and a 1-D one, whose second moment
it keeps whole), four steps of fixed gradients, and for each case of ``CASES`` the parameters after
every step and the optimizer's state after the last one, from
``mlx.optimizers.Adafactor(learning_rate=<lr or schedule>, **config).apply_gradients(...)``, which is
what ``mlx_lm.lora --optimizer adafactor`` builds from ``optimizer_config.adafactor``.

Needs: pip install "mlx[cpu]" (measured with mlx 0.32.4). Run from the project root:

    python scripts/make_tuner_optim_goldens.py
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

OUT = Path("crates/rmlx-lm/tests/fixtures/tuner/optim_goldens.json")
STEPS = 4
SHAPES = {"w": [3, 4], "u": [2, 2, 3], "b": [4]}

# name, Adafactor keyword arguments, learning rate (a number, or [init, end, steps] for
# optim.linear_schedule), dtype.
CASES = [
    ("defaults", {}, 1e-5, "float32"),
    ("beta_1 and weight decay", {"beta_1": 0.9, "weight_decay": 0.1}, 1e-5, "float32"),
    (
        "fixed learning rate, no parameter scale, clipping",
        {"relative_step": False, "scale_parameter": False, "weight_decay": 0.01, "clip_threshold": 0.5},
        0.05,
        "float32",
    ),
    ("scheduled learning rate, first moment", {"relative_step": False, "beta_1": 0.5}, [0.01, 0.04, 3], "float32"),
    # Steps of about 1e-6 of the parameters: the first moment (the scaled update) shows them.
    (
        "warm-up init, decay rate, eps",
        {"warmup_init": True, "decay_rate": -0.5, "eps": [1e-30, 1e-2], "beta_1": 0.0},
        1e-5,
        "float32",
    ),
    ("bfloat16", {"beta_1": 0.9, "weight_decay": 0.1}, 1e-5, "bfloat16"),
]


def values(rng, shape, scale):
    return np.round(rng.standard_normal(shape) * scale, 4)


def flat(a):
    return np.array(a.astype(mx.float32)).reshape(-1).tolist()


def main():
    rng = np.random.RandomState(7)
    params = {k: values(rng, s, 1.0) for k, s in SHAPES.items()}
    grads = [{k: values(rng, s, 0.3) for k, s in SHAPES.items()} for _ in range(STEPS)]
    cases = []
    for name, config, lr, dtype in CASES:
        dt = getattr(mx, dtype)
        learning_rate = optim.linear_schedule(*lr) if isinstance(lr, list) else lr
        opt = optim.Adafactor(learning_rate=learning_rate, **config)
        p = {k: mx.array(v, dtype=dt) for k, v in params.items()}
        steps = []
        for g in grads:
            p = opt.apply_gradients({k: mx.array(v, dtype=dt) for k, v in g.items()}, p)
            mx.eval(p, opt.state)
            steps.append({k: flat(v) for k, v in p.items()})
        state = {f"{k}.{s}": flat(a) for k in SHAPES for s, a in opt.state[k].items()}
        cases.append(
            {"name": name, "config": config, "learning_rate": lr, "dtype": dtype, "steps": steps, "state": state}
        )
    doc = {
        "mlx": mx.__version__,
        "shapes": SHAPES,
        "params": {k: v.reshape(-1).tolist() for k, v in params.items()},
        "grads": [{k: v.reshape(-1).tolist() for k, v in g.items()} for g in grads],
        "cases": cases,
    }
    text = json.dumps(doc, indent=1)
    # One line per list of numbers.
    text = re.sub(r"\[[^\[\]{}]*\]", lambda m: " ".join(m.group(0).split()), text)
    OUT.write_text(text + "\n")
    print(f"wrote {OUT} ({len(cases)} cases, {STEPS} steps each)")


if __name__ == "__main__":
    main()
